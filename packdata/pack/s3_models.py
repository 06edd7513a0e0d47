"""S3 service models loaded once per process tree: a forked DataLoader worker makes its S3 client in milliseconds.

fsspec makes a new ``S3FileSystem`` in every process (its instance cache is
keyed by the process id), and s3fs a new botocore session for it, which reads
and decodes botocore's JSON service models again (about 0.3-0.4 s of CPU on
one core) before its first request. A DataLoader worker is forked afresh each
epoch (without ``persistent_workers``), so every worker of every epoch paid
that before its first byte. :func:`share_models` gives such a filesystem, not
yet connected, a session of its own (its own credentials and options, as s3fs
would make it) whose model loader is one per process: made in the process
that opened the pack (or taken from the session of an S3 filesystem already
connected there), and inherited, models decoded, by the workers it forks.
The loader holds only botocore's read-only model data, never a connection or a
credential. A spawned worker decodes the models once, as before.
"""

from __future__ import annotations

from typing import Any

__all__ = ["share_models"]

_LOADERS: dict[Any, Any] = {}
"""botocore data path -> the loader of its models, in this process (a forked child inherits them, decoded)."""


def share_models(fs: Any) -> None:
    """Share botocore's model loader between ``fs`` (an s3fs filesystem) and the other S3 filesystems of this process.

    ``fs`` with no session yet gets one made as s3fs would make it, with this
    process's loader (a forked worker's: its parent's, models decoded); ``fs``
    with a session (connected earlier, or passed in ``storage_options``)
    lends its loader to the filesystems made after it. Anything else (another
    filesystem, no aiobotocore) is left as it is.
    """
    if type(fs).__module__.split(".")[0] != "s3fs" or not hasattr(fs, "session"):
        return
    try:
        from aiobotocore.session import AioSession
        from botocore.loaders import create_loader
    except ImportError:
        return
    if fs.session is not None:
        session = fs.session
        _LOADERS.setdefault(session.get_config_variable("data_path"), session.get_component("data_loader"))
        return
    session = AioSession(**getattr(fs, "kwargs", {}))
    data_path = session.get_config_variable("data_path")
    loader = _LOADERS.get(data_path)
    if loader is None:
        loader = _LOADERS[data_path] = create_loader(data_path)
    session.register_component("data_loader", loader)
    fs.session = session
