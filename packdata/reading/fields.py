"""What a reader returns for a multi-field pack: which fields, decoded how, transformed how.

``FieldSpec`` is built once from the dataset's arguments and the manifest (so
a typo in a field name fails at construction, naming the pack's fields) and is
picklable, so it travels to ``spawn``-ed workers with the dataset.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from packdata.errors import ConfigError, DecodeError, ImageFormatError, PackFormatError, sample_error
from packdata.pack.fields import KEY_FIELD, LABEL_FIELD
from packdata.pack.images import decoding_sample
from packdata.pack.manifest import Manifest
from packdata.reading.decode import CODEC_DECODERS, DecodeFn, resolve_decoder

__all__ = ["FieldSpec"]


class FieldSpec:
    """The fields to read from a multi-field pack and how to decode and transform each.

    Args:
        manifest: the pack's manifest (kind ``"fields"``).
        fields: names to return, as a tuple in this order (``"__key__"`` and
            ``"cls"`` included); None returns a dict of every field the sample has.
        decode: one decoder name or callable for every field, or a mapping of
            field name -> decoder; fields not named get their codec's default
            (images -> RGB PIL, ``txt`` -> str, ``json`` -> parsed, ``npy`` -> array, else bytes).
        transforms: field name -> callable applied to that field after decoding.
        path: the pack, named in errors about a sample.

    Raises:
        ConfigError: a field, decoder or transform names a field the pack does not have.
    """

    def __init__(
        self,
        manifest: Manifest,
        fields: Sequence[str] | None,
        decode: str | DecodeFn | Mapping[str, str | DecodeFn],
        transforms: Mapping[str, Callable[[Any], Any]] | None,
        *,
        path: str | os.PathLike | None = None,
    ) -> None:
        self.path = os.fspath(path) if path is not None else None
        known = set(manifest.fields) | {KEY_FIELD, LABEL_FIELD}
        if isinstance(fields, str):
            raise ConfigError(f"fields should be a sequence of names, but got fields={fields!r}; write ({fields!r},)")
        self.fields = tuple(fields) if fields is not None else None
        for name in (*(self.fields or ()), *(decode if isinstance(decode, Mapping) else ()), *(transforms or ())):
            if name not in known:
                raise ConfigError(
                    f"the pack has no field {name!r}; its fields are {', '.join(sorted(known))}",
                    hint="Name one of them (see `packdata info` or `packdata ls`)",
                )
        for name in (KEY_FIELD, LABEL_FIELD):
            if isinstance(decode, Mapping) and name in decode:  # it was taken, and never used
                raise ConfigError(
                    f"decode names {name!r}, which is not stored encoded: {KEY_FIELD} is a str, {LABEL_FIELD} an int",
                    hint=f"Transform it instead: transforms={{{name!r}: f}}",
                )
        stored = [n for n in manifest.fields if self.fields is None or n in self.fields]
        self.stored = None if self.fields is None else tuple(stored)  # None: read every stored field
        self.decoders: dict[str, DecodeFn] = {}
        for name in manifest.fields:
            choice = decode.get(name, "auto") if isinstance(decode, Mapping) else decode
            if choice == "auto":
                choice = CODEC_DECODERS[manifest.codecs[name]]
            self.decoders[name] = resolve_decoder(choice)
        self.transforms = dict(transforms or {})
        self.image_fields = frozenset(name for name in manifest.fields if manifest.codecs[name] == "image")

    def wants(self, name: str) -> bool:
        """Whether stored field ``name`` is read."""
        return self.stored is None or name in self.stored

    def build(
        self, stored: dict[str, bytes], key: str, label: int, index: int | None = None
    ) -> dict[str, Any] | tuple[Any, ...]:
        """The sample: decoded, transformed fields (plus ``__key__`` and ``cls``), as a dict or a tuple.

        ``index``, when known, is the sample's position in the pack (named in errors).

        Raises:
            KeyError: a field asked for in ``fields`` is missing from this sample.
            PackFormatError: the sample holds a field the manifest does not list.
            ImageFormatError, DecodeError: a field cannot be decoded (naming the sample and field).
        """
        sample: dict[str, Any] = {KEY_FIELD: self.transforms[KEY_FIELD](key) if KEY_FIELD in self.transforms else key}
        which = f"sample {key!r}" + (f" (index {index})" if index is not None else "")
        for name, data in stored.items():
            decode = self.decoders.get(name)
            if decode is None:
                raise PackFormatError(
                    f"{which} holds field {name!r}, which is not in the manifest (its fields are "
                    f"{', '.join(self.decoders)})",
                    path=self.path,
                    hint="The record does not belong to this pack: run `packdata verify`, then convert it again",
                )
            named = f"{self.path}: {which}, field {name!r}" if name in self.image_fields else None
            token = decoding_sample.set(named.__str__) if named else None  # PIL's bomb warning names it
            try:
                value = decode(data)
            except (ImageFormatError, DecodeError) as exc:
                raise sample_error(exc, f"{which}, field {name!r}", self.path) from exc
            finally:
                if token is not None:
                    decoding_sample.reset(token)
            if name in self.transforms:
                value = self.transforms[name](value)
            sample[name] = value
        if label >= 0:
            sample[LABEL_FIELD] = self.transforms[LABEL_FIELD](label) if LABEL_FIELD in self.transforms else label
        if self.fields is None:
            return sample
        missing = [name for name in self.fields if name not in sample]
        if missing:
            raise KeyError(f"sample {key!r} has no field {missing[0]!r} (it has {', '.join(sorted(sample))})")
        return tuple(sample[name] for name in self.fields)
