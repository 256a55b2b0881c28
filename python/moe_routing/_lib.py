"""ctypes binding of the stable C ABI (``cpp/include/moe_routing/moe_routing.h``).

The structs below mirror the header field by field; their sizes are asserted against the
header's ``static_assert``s (56, 160 and 192 bytes). The library is found and loaded on first
use (:func:`load`), so importing the package needs neither the library nor a GPU.

Lookup order:

1. ``$MOE_ROUTING_LIB``: path of ``libmoe_routing.so`` (if set, nothing else is tried);
2. a copy inside the package: ``moe_routing/lib/libmoe_routing.so`` (or ``.so.1``);
3. the build tree next to the package sources:
   ``<repo>/target/release/moe_routing/lib/libmoe_routing.so``, then
   ``$CARGO_TARGET_DIR/release/moe_routing/lib/libmoe_routing.so`` if that variable is set.
"""

import ctypes
import os
import threading
from ctypes import (
    POINTER,
    c_char_p,
    c_float,
    c_int32,
    c_int64,
    c_size_t,
    c_uint16,
    c_uint32,
    c_void_p,
)
from pathlib import Path
from typing import List, Optional

#: ``MOE_ROUTING_ABI_VERSION`` these bindings are written for.
ABI_VERSION = 1

# Status codes (moe_routing_status).
SUCCESS = 0
INVALID_CONFIG = 1
INVALID_SHAPE = 2
NULL_POINTER = 3
MISALIGNED = 4
BUFFER_TOO_SMALL = 5
FOREIGN_POINTER = 6
CUDA_ERROR = 7
UNSUPPORTED = 8

# Backward precision (MOE_ROUTING_PRECISION_*).
PRECISION_DEFAULT = 0
PRECISION_PRECISE = 1
PRECISION_TORCH_BF16 = 2

# Dtypes of the backward's buffers that come in several (MOE_ROUTING_DTYPE_*).
DTYPE_DECLARED = 0
DTYPE_F32 = 1
DTYPE_BF16 = 2
DTYPE_I32 = 3
DTYPE_I64 = 4

# Bits of kernel_paths' answer (MOE_ROUTING_PATH_*): the fused kernels (else the simple ones).
PATH_FORWARD_FUSED = 1
PATH_BACKWARD_FUSED = 2

# Bits of the args structs' flags (MOE_ROUTING_FLAG_*): CHECKED_DEVICE, the caller has checked
# that every buffer is on `device`, and the library skips its per-buffer runtime queries.
FLAG_CHECKED_DEVICE = 1

LIB_NAME = "libmoe_routing.so"
ENV_VAR = "MOE_ROUTING_LIB"


class MoeRoutingConfig(ctypes.Structure):
    """``moe_routing_config`` (56 bytes)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("norm_topk_prob", c_int32),
        ("hidden_size", c_int64),
        ("n_routed_experts", c_int64),
        ("num_experts_per_tok", c_int64),
        ("n_group", c_int64),
        ("topk_group", c_int64),
        ("routed_scaling_factor", c_float),
        ("reserved", c_uint32),
    ]


class MoeRoutingForwardArgs(ctypes.Structure):
    """``moe_routing_forward_args`` (160 bytes; the first 112 are the first release's, the
    first 144 the second's, the first 152 the third's)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("reserved", c_uint32),
        ("tokens", c_int64),
        ("x", POINTER(c_uint16)),
        ("x_len", c_int64),
        ("w", POINTER(c_uint16)),
        ("w_len", c_int64),
        ("bias", POINTER(c_float)),
        ("bias_len", c_int64),
        ("topk_idx", POINTER(c_int32)),
        ("topk_idx_len", c_int64),
        ("topk_weights", POINTER(c_float)),
        ("topk_weights_len", c_int64),
        ("topk_scores", POINTER(c_float)),
        ("topk_scores_len", c_int64),
        ("scores", POINTER(c_float)),
        ("scores_len", c_int64),
        ("expert_counts", POINTER(c_int32)),
        ("expert_counts_len", c_int64),
        ("flags", c_uint32),
        ("device", c_int32),
        ("topk_idx_dtype", c_int32),  # 0: int32; DTYPE_I64: topk_idx points to int64
        ("reserved2", c_uint32),
    ]


class MoeRoutingBackwardArgs(ctypes.Structure):
    """``moe_routing_backward_args`` (192 bytes; the first 152 are the first release's, the
    first 184 the second's)."""

    _fields_ = [
        ("struct_size", c_uint32),
        ("precision", c_int32),
        ("tokens", c_int64),
        ("x", POINTER(c_uint16)),
        ("x_len", c_int64),
        ("w", POINTER(c_uint16)),
        ("w_len", c_int64),
        ("topk_idx", POINTER(c_int32)),
        ("topk_idx_len", c_int64),
        ("topk_scores", POINTER(c_float)),
        ("topk_scores_len", c_int64),
        ("grad_topk_weights", POINTER(c_float)),
        ("grad_topk_weights_len", c_int64),
        ("grad_x", POINTER(c_uint16)),
        ("grad_x_len", c_int64),
        ("grad_w", POINTER(c_float)),
        ("grad_w_len", c_int64),
        ("workspace", c_void_p),
        ("workspace_bytes", c_int64),
        ("accumulate_grad_w", c_int32),
        ("reserved", c_uint32),
        ("scores", c_void_p),
        ("scores_len", c_int64),
        ("topk_idx_dtype", c_int32),
        ("scores_dtype", c_int32),
        ("grad_topk_weights_dtype", c_int32),
        ("grad_w_dtype", c_int32),
        ("flags", c_uint32),
        ("device", c_int32),
    ]


# The layout is the ABI (the same checks as cpp/src/c_api.cu).
assert ctypes.sizeof(c_void_p) == 8, "the C ABI is defined for 64-bit targets"
assert ctypes.sizeof(MoeRoutingConfig) == 56, "moe_routing_config layout"
assert MoeRoutingConfig.hidden_size.offset == 8, "moe_routing_config layout"
assert MoeRoutingConfig.routed_scaling_factor.offset == 48, "moe_routing_config layout"
assert ctypes.sizeof(MoeRoutingForwardArgs) == 160, "moe_routing_forward_args layout"
assert MoeRoutingForwardArgs.topk_idx_dtype.offset == 152, "moe_routing_forward_args layout"
assert MoeRoutingForwardArgs.tokens.offset == 8, "moe_routing_forward_args layout"
assert MoeRoutingForwardArgs.topk_scores_len.offset == 104, "moe_routing_forward_args layout"
assert MoeRoutingForwardArgs.scores.offset == 112, "moe_routing_forward_args layout"
assert MoeRoutingForwardArgs.flags.offset == 144, "moe_routing_forward_args layout"
assert ctypes.sizeof(MoeRoutingBackwardArgs) == 192, "moe_routing_backward_args layout"
assert MoeRoutingBackwardArgs.scores.offset == 152, "moe_routing_backward_args layout"
assert MoeRoutingBackwardArgs.tokens.offset == 8, "moe_routing_backward_args layout"
assert MoeRoutingBackwardArgs.workspace_bytes.offset == 136, "moe_routing_backward_args layout"
assert MoeRoutingBackwardArgs.accumulate_grad_w.offset == 144, "moe_routing_backward_args layout"


class LibraryError(RuntimeError):
    """The shared library could not be found or loaded, or has another ABI version."""


class MoeRoutingError(RuntimeError):
    """A call into the library returned a non-zero status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _package_dir() -> Path:
    return Path(__file__).resolve().parent


def candidate_paths() -> List[Path]:
    """The paths tried, in order (see the module documentation)."""
    env = os.environ.get(ENV_VAR)
    if env:
        return [Path(env)]
    pkg = _package_dir()
    paths = [pkg / "lib" / LIB_NAME, pkg / "lib" / (LIB_NAME + ".1")]
    repo = pkg.parent.parent  # <repo>/python/moe_routing -> <repo>
    paths.append(repo / "target" / "release" / "moe_routing" / "lib" / LIB_NAME)
    cargo_target = os.environ.get("CARGO_TARGET_DIR")
    if cargo_target:
        paths.append(Path(cargo_target) / "release" / "moe_routing" / "lib" / LIB_NAME)
    return paths


def find_library() -> Optional[Path]:
    """The first existing candidate path, or None."""
    for p in candidate_paths():
        if p.is_file():
            return p
    return None


_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_lib_path: Optional[Path] = None


def _declare(lib: ctypes.CDLL) -> None:
    lib.moe_routing_abi_version.argtypes = []
    lib.moe_routing_abi_version.restype = c_int32
    lib.moe_routing_version_string.argtypes = []
    lib.moe_routing_version_string.restype = c_char_p
    lib.moe_routing_status_string.argtypes = [c_int32]
    lib.moe_routing_status_string.restype = c_char_p
    if hasattr(lib, "moe_routing_last_cuda_error"):  # (libraries from before it: without)
        lib.moe_routing_last_cuda_error.argtypes = []
        lib.moe_routing_last_cuda_error.restype = c_char_p
    lib.moe_routing_validate_config.argtypes = [POINTER(MoeRoutingConfig)]
    lib.moe_routing_validate_config.restype = c_int32
    lib.moe_routing_backward_workspace_bytes.argtypes = [POINTER(MoeRoutingConfig), c_int64]
    lib.moe_routing_backward_workspace_bytes.restype = c_size_t
    lib.moe_routing_forward.argtypes = [
        POINTER(MoeRoutingConfig),
        POINTER(MoeRoutingForwardArgs),
        c_void_p,
    ]
    lib.moe_routing_forward.restype = c_int32
    lib.moe_routing_backward.argtypes = [
        POINTER(MoeRoutingConfig),
        POINTER(MoeRoutingBackwardArgs),
        c_void_p,
    ]
    lib.moe_routing_backward.restype = c_int32
    lib.moe_routing_device_count.argtypes = []
    lib.moe_routing_device_count.restype = c_int32
    if hasattr(lib, "moe_routing_kernel_paths"):  # (added in ABI 1's third release)
        lib.moe_routing_kernel_paths.argtypes = [POINTER(MoeRoutingConfig), POINTER(c_uint32)]
        lib.moe_routing_kernel_paths.restype = c_int32


def open_library(path) -> ctypes.CDLL:
    """Loads the library at `path`, declares its functions and checks its ABI version."""
    path = Path(path)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise LibraryError(f"cannot load the moe_routing library {path}: {e}") from e
    try:
        _declare(lib)
    except AttributeError as e:
        raise LibraryError(f"{path} is not the moe_routing library (missing symbol: {e})") from e
    got = lib.moe_routing_abi_version()
    if got != ABI_VERSION:
        raise LibraryError(
            f"{path} has C ABI version {got}, but this Python package needs version "
            f"{ABI_VERSION}: install the package and the library from the same release"
        )
    return lib


def load() -> ctypes.CDLL:
    """The loaded library (found and loaded once); raises :class:`LibraryError`."""
    global _lib, _lib_path
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        path = find_library()
        if path is None:
            tried = "\n  ".join(str(p) for p in candidate_paths())
            raise LibraryError(
                f"{LIB_NAME} not found. Tried:\n  {tried}\n"
                f"Build it with `cargo xtask package` in the moe-routing repository, then "
                f"set {ENV_VAR}=/path/to/target/release/moe_routing/lib/{LIB_NAME} or copy it "
                f"to {_package_dir() / 'lib' / LIB_NAME}."
            )
        _lib = open_library(path)
        _lib_path = path
        return _lib


def library_path() -> Optional[Path]:
    """Path of the loaded library, or of the one :func:`load` would load (None if none)."""
    return _lib_path if _lib is not None else find_library()


def status_string(status: int) -> str:
    """The library's text for a status code."""
    s = load().moe_routing_status_string(int(status))
    return s.decode() if s is not None else "unknown status"


def last_cuda_error() -> str:
    """The CUDA error behind this thread's last CUDA_ERROR status, as the runtime names and
    describes it ("" if none, or if the library predates it)."""
    lib = load()
    if not hasattr(lib, "moe_routing_last_cuda_error"):
        return ""
    s = lib.moe_routing_last_cuda_error()
    return s.decode(errors="replace") if s is not None else ""


def check_status(status: int, what: str) -> None:
    """Raises :class:`MoeRoutingError` for a non-zero status; a CUDA error's message ends with
    the runtime's name and description of it."""
    if status != SUCCESS:
        detail = last_cuda_error() if status == CUDA_ERROR else ""
        raise MoeRoutingError(
            status,
            f"{what} failed: {status_string(status)}{': ' + detail if detail else ''} "
            f"(status {status})")


def make_config(
    hidden_size: int,
    n_routed_experts: int,
    num_experts_per_tok: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool,
) -> MoeRoutingConfig:
    return MoeRoutingConfig(
        struct_size=ctypes.sizeof(MoeRoutingConfig),
        norm_topk_prob=1 if norm_topk_prob else 0,
        hidden_size=hidden_size,
        n_routed_experts=n_routed_experts,
        num_experts_per_tok=num_experts_per_tok,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=routed_scaling_factor,
        reserved=0,
    )


def ptr(address: int, ctype):
    """A typed pointer from an integer address (a tensor's data_ptr())."""
    return ctypes.cast(c_void_p(address), POINTER(ctype))


def abi_version() -> int:
    return int(load().moe_routing_abi_version())


def version() -> str:
    return load().moe_routing_version_string().decode()


def device_count() -> int:
    return int(load().moe_routing_device_count())


def kernel_paths(cfg: MoeRoutingConfig) -> Optional[int]:
    """The ``PATH_*`` bits of the kernels `cfg` takes (``moe_routing_kernel_paths``); None
    where the library predates that call. Raises :class:`MoeRoutingError` for an invalid
    config."""
    lib = load()
    if not hasattr(lib, "moe_routing_kernel_paths"):
        return None
    paths = c_uint32(0)
    check_status(lib.moe_routing_kernel_paths(ctypes.byref(cfg), ctypes.byref(paths)),
                 "moe_routing_kernel_paths")
    return int(paths.value)


def kernel_path_names(cfg: MoeRoutingConfig) -> Optional[dict]:
    """:func:`kernel_paths` as ``{"forward": "fused" | "simple", "backward": ...}``; None where
    the library predates that call."""
    bits = kernel_paths(cfg)
    if bits is None:
        return None
    return {
        "forward": "fused" if bits & PATH_FORWARD_FUSED else "simple",
        "backward": "fused" if bits & PATH_BACKWARD_FUSED else "simple",
    }


def validate_config(cfg: MoeRoutingConfig) -> int:
    return int(load().moe_routing_validate_config(ctypes.byref(cfg)))


def backward_workspace_bytes(cfg: MoeRoutingConfig, tokens: int) -> int:
    return int(load().moe_routing_backward_workspace_bytes(ctypes.byref(cfg), int(tokens)))
