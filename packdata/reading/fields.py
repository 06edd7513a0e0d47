"""What a reader returns for a multi-field pack: which fields, decoded how, transformed how.

``FieldSpec`` is built once from the dataset's arguments and the manifest (so
a typo in a field name, or a field some samples lack, fails at construction,
naming the pack's fields) and is picklable, so it travels to ``spawn``-ed
workers with the dataset.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch.utils.data._utils.collate import collate, default_collate_fn_map

from packdata.errors import ConfigError, DecodeError, ImageFormatError, MissingFieldError, PackFormatError, sample_error
from packdata.pack.fields import KEY_FIELD, LABEL_FIELD
from packdata.pack.images import decoding_sample
from packdata.pack.index import unlabelled
from packdata.pack.manifest import Manifest
from packdata.reading.decode import CODEC_DECODERS, DecodeFn, resolve_decoder
from packdata.reading.pack_info import PackInfo

__all__ = ["FieldSpec", "SampleDict"]


class SampleDict(dict):
    """A multi-field sample read with ``fields=None``: a dict whose lookup of a field it lacks names the field.

    ``sample["mask"]`` on a sample without a mask raises :class:`~packdata.errors.MissingFieldError`
    (a ``KeyError`` too) naming the pack, the sample's key and the fields it holds, with the ways out;
    ``sample["jgp"]``, a name no sample of the pack holds, raises it naming the pack's fields and the
    closest of them (``in`` and ``get`` are a dict's: no error).
    Torch's default collate batches samples that all hold the same fields and raises it for a batch whose
    samples differ (it would keep only the first sample's fields): this module registers that check in
    torch's ``default_collate_fn_map``, for SampleDicts only, so ``collate_fn=packdata.fields_collate`` or
    a collate of one's own sees the samples as they are.
    """

    def __init__(self, fields: dict[str, Any], pack: str | None, known: tuple[str, ...] | None = None) -> None:
        super().__init__(fields)
        self.pack = pack
        self.known = known  # the pack's stored fields (its manifest's), when known

    def __missing__(self, name: str) -> Any:
        key = self.get(KEY_FIELD)
        held = ", ".join(repr(field) for field in self if field != KEY_FIELD) or "none"
        if self.known is not None and name not in (*self.known, KEY_FIELD, LABEL_FIELD):
            what, hint = _unknown_field(name, self.known)
            raise MissingFieldError(what, path=self.pack, hint=hint)
        if isinstance(key, list):  # a batch torch's default collate made: every sample of it holds its fields
            first = f" (the first: {key[0]!r})" if key else ""
            what = f"the batch holds no field {name!r}: none of its {len(key)} samples{first} holds it"
            what += f" (they hold {held})"
        else:
            what = f"sample {key!r} holds no field {name!r} (it holds {held})"
        raise MissingFieldError(what, path=self.pack, hint=_ways_out(name))


def _unknown_field(name: object, known: Sequence[str]) -> tuple[str, str]:
    """The message and hint of an error about field ``name``, which none of ``known`` (the pack's fields) is."""
    names = sorted({*known, KEY_FIELD, LABEL_FIELD})
    close = difflib.get_close_matches(name, names, n=1) if isinstance(name, str) else []
    guess = f"Did you mean {close[0]!r}? " if close else ""
    what = f"the pack has no field {name!r} (its fields: {', '.join(repr(n) for n in names)})"
    return what, f"{guess}Name one of the pack's fields (`packdata info` lists them)"


def _ways_out(name: str) -> str:
    """The hint of a :class:`MissingFieldError` about field ``name``."""
    return (
        "The pack's samples do not all hold the same fields: batch them with collate_fn=packdata.fields_collate "
        "(a field a sample lacks reads None; packdata.FieldsCollate(missing=VALUE) reads VALUE), or pass "
        f"missing={{{name!r}: VALUE}} to the dataset to read VALUE in its place"
    )


def _collate_sample_dicts(batch: Sequence[Any], *, collate_fn_map: dict[Any, Callable[..., Any]] | None) -> Any:
    """Torch's default collate of SampleDicts: each field collated as torch would, the batch a SampleDict too.

    Raises:
        MissingFieldError: the samples do not all hold the same fields, naming the first sample that lacks
            a field another holds.
    """
    first = batch[0]
    dicts = [sample for sample in batch if isinstance(sample, Mapping)]
    if any(sample.keys() != first.keys() for sample in dicts):
        names = dict.fromkeys(name for sample in dicts for name in sample)
        lacking = next(sample for sample in dicts if sample.keys() != names.keys())
        name = next(name for name in names if name not in lacking)
        holder = next(sample for sample in dicts if name in sample)
        held = ", ".join(repr(field) for field in lacking if field != KEY_FIELD) or "none"
        raise MissingFieldError(
            f"sample {lacking.get(KEY_FIELD)!r} holds no field {name!r} (it holds {held}), which sample "
            f"{holder.get(KEY_FIELD)!r} of the same batch holds: torch's default collate cannot batch dicts of "
            "different fields (it keeps the first sample's)",
            path=first.pack,
            hint=_ways_out(name),
        )
    out = SampleDict({}, first.pack, first.known)
    for name in first:
        out[name] = collate([sample[name] for sample in batch], collate_fn_map=collate_fn_map)
    return out


default_collate_fn_map[SampleDict] = _collate_sample_dicts  # torch's documented way to extend default_collate


class FieldSpec:
    """The fields to read from a multi-field pack and how to decode and transform each.

    Args:
        manifest: the pack's manifest (kind ``"fields"``).
        fields: names to return, as a tuple in this order (``"__key__"`` and
            ``"cls"`` included); None returns a dict of every field the sample has.
        decode: one decoder name or callable for every field, or a mapping of
            field name -> decoder; fields not named get their codec's default
            (images -> RGB PIL, ``txt`` -> str, ``json`` -> parsed, ``npy`` -> array, ``seg.cls`` -> int,
            else bytes; no decoder unpickles).
        transforms: field name -> callable applied to that field after decoding.
        path: the pack, named in errors about a sample.
        missing: field name -> the value a sample that lacks the field reads
            in its place (as given: not decoded, not transformed); without it,
            ``fields`` may name only fields every sample holds (:meth:`check_present`).

    Raises:
        ConfigError: a field, decoder, transform or ``missing`` names a field the pack does not have.
    """

    def __init__(
        self,
        manifest: Manifest,
        fields: Sequence[str] | None,
        decode: str | DecodeFn | Mapping[str, str | DecodeFn],
        transforms: Mapping[str, Callable[[Any], Any]] | None,
        *,
        path: str | os.PathLike | None = None,
        missing: Mapping[str, Any] | None = None,
    ) -> None:
        self.path = os.fspath(path) if path is not None else None
        self.num_samples = manifest.num_samples
        known = set(manifest.fields) | {KEY_FIELD, LABEL_FIELD}
        if isinstance(fields, str):
            raise ConfigError(f"fields should be a sequence of names, but got fields={fields!r}; write ({fields!r},)")
        self.fields = tuple(fields) if fields is not None else None
        if missing is not None and not isinstance(missing, Mapping):
            raise ConfigError(f"missing should map field names to values, but got missing={missing!r}", path=path)
        self.missing = dict(missing or {})
        names = (*(self.fields or ()), *(decode if isinstance(decode, Mapping) else ()), *(transforms or ()))
        for name in (*names, *self.missing):
            if name not in known:
                what, hint = _unknown_field(name, manifest.fields)
                raise ConfigError(what, path=path, hint=hint)
        for name in (KEY_FIELD, LABEL_FIELD):
            if isinstance(decode, Mapping) and name in decode:  # it was taken, and never used
                raise ConfigError(
                    f"decode names {name!r}, which is not stored encoded: {KEY_FIELD} is a str, {LABEL_FIELD} an int",
                    hint=f"Transform it instead: transforms={{{name!r}: f}}",
                )
        for name in self.missing:
            if name == KEY_FIELD or (self.fields is not None and name not in self.fields):
                why = "every sample has a key" if name == KEY_FIELD else "fields does not ask for it"
                raise ConfigError(f"missing names {name!r}, but {why}: its value would never be used", path=path)
        stored = [n for n in manifest.fields if self.fields is None or n in self.fields]
        self.stored = None if self.fields is None else tuple(stored)  # None: read every stored field
        self.decoders: dict[str, DecodeFn] = {}
        for name in manifest.fields:
            choice = decode.get(name, "auto") if isinstance(decode, Mapping) else decode
            if choice == "auto":
                choice = CODEC_DECODERS[manifest.codecs[name]]
            self.decoders[name] = resolve_decoder(choice)
        self.transforms = dict(transforms or {})
        self.known = tuple(manifest.fields)
        self.image_fields = frozenset(name for name in manifest.fields if manifest.codecs[name] == "image")

    def check_present(self, pack: PackInfo) -> None:
        """Raise unless every sample holds each field ``fields`` asks for without a ``missing`` value.

        By the sample index (one pass over its field pairs, or labels for ``cls``), checked against the
        manifest's ``field_counts``: a reader never meets a sample without a field mid-epoch.

        Raises:
            ConfigError: naming the field, how many samples lack it and the first of them.
            PackFormatError: the manifest's field counts are not the sample index's.
        """
        counts = pack.field_counts()
        for name in self.fields or ():
            if name == KEY_FIELD or name in self.missing:
                continue
            if name == LABEL_FIELD:
                first, lacking = unlabelled(pack.index.labels) or (None, 0)
            else:
                lacking = self.num_samples - counts[name]
                first = pack.index.first_lacking(name) if lacking else None
            if first is None:
                continue
            also = (
                f"; converting with require=[{name!r}] (`packdata convert --require {name}`) skips samples without it"
            )
            also = also if name != LABEL_FIELD else ""
            raise ConfigError(
                f"fields asks for {name!r}, which {lacking} of the pack's {self.num_samples} samples lack "
                f"(the first: sample {pack.index.keys[first]!r}, index {first})",
                path=self.path,
                hint=f"Pass missing={{{name!r}: VALUE}} to read VALUE in its place, or fields=None for a dict of "
                f"the fields each sample holds{also}",
            )

    def wants(self, name: str) -> bool:
        """Whether stored field ``name`` is read."""
        return self.stored is None or name in self.stored

    def build(
        self, stored: dict[str, bytes], key: str, label: int, index: int | None = None
    ) -> dict[str, Any] | tuple[Any, ...]:
        """The sample: decoded, transformed fields (plus ``__key__`` and ``cls``), as a dict or a tuple.

        ``index``, when known, is the sample's position in the pack (named in errors).

        Raises:
            PackFormatError: the sample holds a field the manifest does not list, or lacks one
                ``fields`` asks for without a ``missing`` value (its record is not the index's).
            ImageFormatError, DecodeError: a field cannot be decoded (naming the sample and field).
        """
        sample: dict[str, Any] = SampleDict({}, self.path, self.known) if self.fields is None else {}  # returned
        sample[KEY_FIELD] = self.transforms[KEY_FIELD](key) if KEY_FIELD in self.transforms else key
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
            for name, value in self.missing.items():
                if name not in sample:
                    sample[name] = value
            return sample
        absent = [name for name in self.fields if name not in sample and name not in self.missing]
        if absent:
            raise PackFormatError(
                f"{which} holds no field {absent[0]!r}, which the sample index lists for every sample",
                path=self.path,
                hint="The record does not match the sample index: run `packdata verify` on the pack",
            )
        return tuple(sample[name] if name in sample else self.missing[name] for name in self.fields)
