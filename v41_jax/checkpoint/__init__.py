"""The published checkpoint format: lazy reader/writer, schema, conversion to params, orbax cache."""

from .converted import load_params_cached
from .load import EngramTables, load_params
from .safetensors_io import Checkpoint, CheckpointError, write_checkpoint
from .schema import SchemaOptions, TensorSpec, checkpoint_schema, validate_checkpoint

__all__ = ["Checkpoint", "CheckpointError", "EngramTables", "SchemaOptions", "TensorSpec",
           "checkpoint_schema", "load_params", "load_params_cached", "validate_checkpoint",
           "write_checkpoint"]
