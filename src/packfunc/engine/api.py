"""The engine's interface for the BackPACK shim (``packfunc.compat``): one import for it all.

The shim records the user's own forward pass with the engine's vocabulary (which
calls consume parameters, how reshapes and linear layers look) and hands the
record to a :class:`BatchPass`; it imports these names from here and nothing else
of the engine, so what the shim depends on is listed in one place.
"""

from packfunc.engine.attention import ATTENTION_OPS
from packfunc.engine.autodiff import refuse_differentiation
from packfunc.engine.batch_pass import BatchPass, check_rerun
from packfunc.engine.batch_record import (
    BatchRecord,
    SiteConsumer,
    autograd_record,
    graph_owner,
    sample_layout,
)
from packfunc.engine.discovery import (
    FixedTensors,
    Plan,
    Recorded,
    RowsNotAloneError,
    Use,
    UseKind,
    cached_discover,
    in_out_weights_of,
)
from packfunc.engine.layer_factors import CURVATURES
from packfunc.engine.local import CallArguments, LocalInputs, Source
from packfunc.engine.model_state import packfunc_passes
from packfunc.engine.modes import (
    Derived,
    FunctionalMode,
    LeafIndex,
    is_metadata_query,
    leaves_of,
    parameter_sources,
    remember_derivations,
    tensor_outputs,
)
from packfunc.engine.nested_encoders import NESTED_ENCODER_FIX, runs_nested_in_users_forward
from packfunc.engine.ops import (
    LINEAR_CALLS,
    RESHAPES,
    SIGNATURES,
    FlatRows,
    linear_in_out,
    make_call,
)
from packfunc.engine.precision import (
    autocast_in_force,
    difference_beyond_rounding,
    forward_precision_only,
    narrowest,
    serving_autocast,
)
from packfunc.engine.randomness import random_call
from packfunc.engine.recurrent import RECURRENT_OPS

__all__ = [
    "ATTENTION_OPS",
    "CURVATURES",
    "LINEAR_CALLS",
    "RECURRENT_OPS",
    "RESHAPES",
    "SIGNATURES",
    "BatchPass",
    "BatchRecord",
    "SiteConsumer",
    "CallArguments",
    "Derived",
    "FixedTensors",
    "FlatRows",
    "FunctionalMode",
    "LeafIndex",
    "LocalInputs",
    "NESTED_ENCODER_FIX",
    "Plan",
    "Recorded",
    "RowsNotAloneError",
    "Source",
    "Use",
    "UseKind",
    "autocast_in_force",
    "autograd_record",
    "graph_owner",
    "cached_discover",
    "in_out_weights_of",
    "check_rerun",
    "difference_beyond_rounding",
    "forward_precision_only",
    "serving_autocast",
    "is_metadata_query",
    "leaves_of",
    "linear_in_out",
    "make_call",
    "narrowest",
    "packfunc_passes",
    "parameter_sources",
    "random_call",
    "refuse_differentiation",
    "remember_derivations",
    "runs_nested_in_users_forward",
    "sample_layout",
    "tensor_outputs",
]
