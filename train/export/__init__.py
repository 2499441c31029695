"""Export formats (one module each, registered in :data:`train.export.core.FORMATS`) and stage export
(:mod:`train.export.stage`): a trained drafter turned into the files a serving engine loads, checked before it is
written."""

from train.export.core import FORMATS, ExportError, Format, valid_pairs
from train.export.stage import drafter_family, export_drafter, find_train_manifest, read_deploy, read_eval, run_export

__all__ = [
    "FORMATS",
    "ExportError",
    "Format",
    "drafter_family",
    "export_drafter",
    "find_train_manifest",
    "read_deploy",
    "read_eval",
    "run_export",
    "valid_pairs",
]
