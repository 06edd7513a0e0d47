"""The ``packdata`` command: thin click commands over the Python API.

Results go to stdout (``--json`` where machines read them), progress and logs to
stderr. A :class:`~packdata.errors.PackdataError` becomes one ``Error: ...``
line and exit status 1; bad options exit 2; anything else is a bug and keeps
its traceback. A command whose stdout reader went away (``| head``) exits 141
quietly, as git and seq do.

This module holds the ``main`` group (the console script) and adds the
commands from one module per room they call: ``conversion`` (convert, merge),
``inspection`` (info, verify, ls, cat, export), ``measure`` (bench, tune),
``staging`` (stage, unstage, doctor) and ``watch`` (monitor); what they share
is in ``common``. Each command imports the library inside its body, so
``import packdata.cli`` stays light.
"""

from __future__ import annotations

import click

from packdata._version import __version__
from packdata.cli import conversion, inspection, measure, staging, watch
from packdata.cli.common import _Main, _teach_metavars, as_flags

__all__ = ["as_flags", "main"]


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="packdata")
def main() -> None:
    """Pack folders of small files into LMDB or TFRecord and feed PyTorch fast.

    \b
    Typical use:
      packdata convert ./images train.lmdb        # pack an ImageFolder tree
      packdata info train.lmdb                    # what is inside
      packdata verify train.lmdb                  # read and check every record
    Then in Python: packdata.LMDBDataset("train.lmdb") where ImageFolder was.
    """


main.add_command(conversion.convert)
main.add_command(conversion.merge)
main.add_command(inspection.info)
main.add_command(inspection.verify)
main.add_command(inspection.ls)
main.add_command(inspection.cat)
main.add_command(inspection.export)
main.add_command(measure.bench)
main.add_command(measure.tune)
main.add_command(staging.stage)
main.add_command(staging.unstage)
main.add_command(staging.doctor)
main.add_command(watch.monitor_command)
_teach_metavars(main)
