"""Pure array math for gradient compression: no collectives, no optax.

Each codec turns arrays into the payload that goes on the wire and back.
Nothing here knows about workers or axis names; ``compjax.collectives`` moves
the payloads and ``compjax.compressors`` adds error feedback and state.
"""

from compjax.codecs.bucket import Bucket, make_bucket
from compjax.codecs.lowrank import matrix_shape, orthonormalize, to_matrix, from_matrix, use_lowrank
from compjax.codecs.sparse import topk_select, layer_k

__all__ = [
    "Bucket",
    "make_bucket",
    "matrix_shape",
    "orthonormalize",
    "to_matrix",
    "from_matrix",
    "use_lowrank",
    "topk_select",
    "layer_k",
]
