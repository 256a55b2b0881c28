//! The C ABI (`cpp/include/moe_routing/moe_routing.h`), called from Rust through its symbols in
//! the crate's CUDA archive: layout, version, status strings, config validation and the
//! argument checks that come before any CUDA call. Needs no GPU.
//!
//! Forward and backward calls with well-formed structs reach the CUDA runtime, which answers
//! `MOE_ROUTING_CUDA_ERROR` without a GPU and checks the buffers on one; those cases are left
//! to the GPU tests. Every call here returns the same status with or without a GPU.

use std::ffi::{c_char, c_void, CStr};
use std::mem::{offset_of, size_of};
use std::ptr::{null, null_mut};

use moe_routing::{RouterConfig, Status};

#[repr(C)]
#[derive(Clone, Copy)]
struct Config {
    struct_size: u32,
    norm_topk_prob: i32,
    hidden_size: i64,
    n_routed_experts: i64,
    num_experts_per_tok: i64,
    n_group: i64,
    topk_group: i64,
    routed_scaling_factor: f32,
    reserved: u32,
}

#[repr(C)]
struct ForwardArgs {
    struct_size: u32,
    reserved: u32,
    tokens: i64,
    x: *const u16,
    x_len: i64,
    w: *const u16,
    w_len: i64,
    bias: *const f32,
    bias_len: i64,
    topk_idx: *mut i32,
    topk_idx_len: i64,
    topk_weights: *mut f32,
    topk_weights_len: i64,
    topk_scores: *mut f32,
    topk_scores_len: i64,
    scores: *mut f32,
    scores_len: i64,
    expert_counts: *mut i32,
    expert_counts_len: i64,
    flags: u32,
    device: i32,
    topk_idx_dtype: i32,
    reserved2: u32,
}

#[repr(C)]
struct BackwardArgs {
    struct_size: u32,
    precision: i32,
    tokens: i64,
    x: *const u16,
    x_len: i64,
    w: *const u16,
    w_len: i64,
    topk_idx: *const i32,
    topk_idx_len: i64,
    topk_scores: *const f32,
    topk_scores_len: i64,
    grad_topk_weights: *const f32,
    grad_topk_weights_len: i64,
    grad_x: *mut u16,
    grad_x_len: i64,
    grad_w: *mut f32,
    grad_w_len: i64,
    workspace: *mut c_void,
    workspace_bytes: i64,
    accumulate_grad_w: i32,
    reserved: u32,
    scores: *const c_void,
    scores_len: i64,
    topk_idx_dtype: i32,
    scores_dtype: i32,
    grad_topk_weights_dtype: i32,
    grad_w_dtype: i32,
    flags: u32,
    device: i32,
}

extern "C" {
    fn moe_routing_abi_version() -> i32;
    fn moe_routing_version_string() -> *const c_char;
    fn moe_routing_status_string(status: i32) -> *const c_char;
    fn moe_routing_validate_config(config: *const Config) -> i32;
    fn moe_routing_backward_workspace_bytes(config: *const Config, tokens: i64) -> usize;
    fn moe_routing_forward(
        config: *const Config,
        args: *const ForwardArgs,
        stream: *mut c_void,
    ) -> i32;
    fn moe_routing_backward(
        config: *const Config,
        args: *const BackwardArgs,
        stream: *mut c_void,
    ) -> i32;
    fn moe_routing_device_count() -> i32;
    fn moe_routing_kernel_paths(config: *const Config, paths: *mut u32) -> i32;
    fn moe_routing_last_cuda_error() -> *const c_char;
}

const SUCCESS: i32 = 0;
const INVALID_CONFIG: i32 = 1;
const NULL_POINTER: i32 = 3;
const MISALIGNED: i32 = 4;
const BUFFER_TOO_SMALL: i32 = 5;
const FOREIGN_POINTER: i32 = 6;
const CUDA_ERROR: i32 = 7;
const UNSUPPORTED: i32 = 8;

fn glm() -> Config {
    Config {
        struct_size: size_of::<Config>() as u32,
        norm_topk_prob: 1,
        hidden_size: 5120,
        n_routed_experts: 160,
        num_experts_per_tok: 8,
        n_group: 8,
        topk_group: 4,
        routed_scaling_factor: 2.5,
        reserved: 0,
    }
}

fn forward_args() -> ForwardArgs {
    ForwardArgs {
        struct_size: size_of::<ForwardArgs>() as u32,
        reserved: 0,
        tokens: 0,
        x: null(),
        x_len: 0,
        w: null(),
        w_len: 0,
        bias: null(),
        bias_len: 0,
        topk_idx: null_mut(),
        topk_idx_len: 0,
        topk_weights: null_mut(),
        topk_weights_len: 0,
        topk_scores: null_mut(),
        topk_scores_len: 0,
        scores: null_mut(),
        scores_len: 0,
        expert_counts: null_mut(),
        expert_counts_len: 0,
        flags: 0,
        device: 0,
        topk_idx_dtype: 0,
        reserved2: 0,
    }
}

fn backward_args() -> BackwardArgs {
    BackwardArgs {
        struct_size: size_of::<BackwardArgs>() as u32,
        precision: 0,
        tokens: 0,
        x: null(),
        x_len: 0,
        w: null(),
        w_len: 0,
        topk_idx: null(),
        topk_idx_len: 0,
        topk_scores: null(),
        topk_scores_len: 0,
        grad_topk_weights: null(),
        grad_topk_weights_len: 0,
        grad_x: null_mut(),
        grad_x_len: 0,
        grad_w: null_mut(),
        grad_w_len: 0,
        workspace: null_mut(),
        workspace_bytes: 0,
        accumulate_grad_w: 0,
        reserved: 0,
        scores: null(),
        scores_len: 0,
        topk_idx_dtype: 0,
        scores_dtype: 0,
        grad_topk_weights_dtype: 0,
        grad_w_dtype: 0,
        flags: 0,
        device: 0,
    }
}

fn text(p: *const c_char) -> String {
    assert!(!p.is_null());
    unsafe { CStr::from_ptr(p) }.to_str().unwrap().to_owned()
}

fn validate(c: &Config) -> i32 {
    unsafe { moe_routing_validate_config(c) }
}

#[test]
fn layout_matches_the_header() {
    // The sizes and offsets c_api.cu asserts.
    assert_eq!(size_of::<Config>(), 56);
    assert_eq!(offset_of!(Config, hidden_size), 8);
    assert_eq!(offset_of!(Config, routed_scaling_factor), 48);
    assert_eq!(size_of::<ForwardArgs>(), 160);
    assert_eq!(offset_of!(ForwardArgs, topk_idx_dtype), 152); // MOE_ROUTING_FORWARD_ARGS_SIZE_V3
    assert_eq!(offset_of!(ForwardArgs, flags), 144); // MOE_ROUTING_FORWARD_ARGS_SIZE_V2
    assert_eq!(offset_of!(ForwardArgs, topk_scores_len), 104);
    assert_eq!(offset_of!(ForwardArgs, scores), 112); // MOE_ROUTING_FORWARD_ARGS_SIZE_V1
    assert_eq!(offset_of!(ForwardArgs, expert_counts_len), 136);
    assert_eq!(size_of::<BackwardArgs>(), 192);
    assert_eq!(offset_of!(BackwardArgs, flags), 184); // MOE_ROUTING_BACKWARD_ARGS_SIZE_V2
    assert_eq!(offset_of!(BackwardArgs, scores), 152); // MOE_ROUTING_BACKWARD_ARGS_SIZE_V1
    assert_eq!(offset_of!(BackwardArgs, workspace_bytes), 136);
    assert_eq!(offset_of!(BackwardArgs, accumulate_grad_w), 144);
}

#[test]
fn version() {
    assert_eq!(unsafe { moe_routing_abi_version() }, 1);
    assert_eq!(
        text(unsafe { moe_routing_version_string() }),
        env!("CARGO_PKG_VERSION")
    );
}

#[test]
fn status_codes_and_strings() {
    // The C codes are the crate's `Status` in order, and the C++ `Status` values.
    let statuses = [
        (Status::Success, "success"),
        (Status::InvalidConfig, "invalid router config"),
        (Status::InvalidShape, "invalid shape"),
        (Status::NullPointer, "null pointer"),
        (Status::Misaligned, "misaligned pointer"),
        (Status::BufferTooSmall, "buffer too small"),
        (
            Status::ForeignPointer,
            "pointer is not device memory of the stream's device",
        ),
        (Status::Cuda, "CUDA error"),
        (Status::Unsupported, "unsupported"),
    ];
    for (code, (status, want)) in statuses.into_iter().enumerate() {
        assert_eq!(status as i32, code as i32);
        assert_eq!(
            text(unsafe { moe_routing_status_string(code as i32) }),
            want
        );
    }
    for code in [-1, 9, i32::MAX, i32::MIN] {
        assert_eq!(
            text(unsafe { moe_routing_status_string(code) }),
            "unknown status"
        );
    }
}

#[test]
fn config_validation_agrees_with_the_crate() {
    let c = glm();
    assert_eq!(validate(&c), SUCCESS);
    type Edit = fn(&mut Config);
    let cases: [(&str, Edit); 7] = [
        ("n_group 7", |c| c.n_group = 7),
        ("topk_group > n_group", |c| c.topk_group = 9),
        ("H not a multiple of 8", |c| c.hidden_size = 5124),
        ("K = 0", |c| c.num_experts_per_tok = 0),
        ("scale NaN", |c| c.routed_scaling_factor = f32::NAN),
        ("norm_topk_prob 2", |c| c.norm_topk_prob = 2),
        ("reserved", |c| c.reserved = 1),
    ];
    for (what, edit) in cases {
        let mut bad = c;
        edit(&mut bad);
        assert_eq!(validate(&bad), INVALID_CONFIG, "{what}");
    }
    // The crate's config checks give the same answers on the fields both have.
    for (g, tg) in [(1, 1), (4, 2), (8, 4), (16, 8), (7, 1), (8, 9)] {
        let rust = RouterConfig::glm45(g, tg);
        let c = Config {
            n_group: g as i64,
            topk_group: tg as i64,
            ..glm()
        };
        let crate_ok = moe_routing::Router::new(rust).is_ok();
        assert_eq!(
            validate(&c) == SUCCESS,
            crate_ok,
            "n_group {g}, topk_group {tg}"
        );
    }
}

#[test]
fn struct_size_must_match() {
    let full = size_of::<Config>() as u32;
    for size in [0, 8, full - 8, full + 8, u32::MAX] {
        let c = Config {
            struct_size: size,
            ..glm()
        };
        assert_eq!(validate(&c), INVALID_CONFIG, "struct_size {size}");
        assert_eq!(unsafe { moe_routing_backward_workspace_bytes(&c, 256) }, 0);
    }
    let c = glm();
    let mut f = forward_args();
    f.struct_size -= 4;
    assert_eq!(
        unsafe { moe_routing_forward(&c, &f, null_mut()) },
        INVALID_CONFIG
    );
    let mut b = backward_args();
    b.struct_size += 8;
    assert_eq!(
        unsafe { moe_routing_backward(&c, &b, null_mut()) },
        INVALID_CONFIG
    );
}

#[test]
fn first_release_forward_args_are_accepted() {
    // The struct before the optional outputs were appended: accepted, and the bytes after it
    // (here a counts buffer too small for E) are not read.
    let c = glm();
    let mut counts = [0i32; 1];
    let f = ForwardArgs {
        expert_counts: counts.as_mut_ptr(),
        expert_counts_len: 0,
        ..forward_args()
    };
    assert_eq!(
        unsafe { moe_routing_forward(&c, &f, null_mut()) },
        BUFFER_TOO_SMALL
    );
    let v1 = ForwardArgs {
        struct_size: 112,
        ..f
    };
    let got = unsafe { moe_routing_forward(&c, &v1, null_mut()) };
    assert!(got != INVALID_CONFIG && got != BUFFER_TOO_SMALL, "{got}");
}

#[test]
fn forward_index_dtype() {
    // int32 (declared) or int64 indices; an index buffer's capacity counts in its own elements,
    // its alignment is its element's; any other dtype, or a nonzero reserved2, is an invalid
    // config; a third-release struct (before the dtype) reads int32.
    let c = glm();
    let (h, e) = (c.hidden_size, c.n_routed_experts);
    // (Aligned addresses that are never read: the host checks look at pointers and lengths.)
    let base = ForwardArgs {
        tokens: 1,
        x: 0x10000 as *const u16,
        x_len: h,
        w: 0x20000 as *const u16,
        w_len: e * h,
        bias: 0x30000 as *const f32,
        bias_len: e,
        topk_idx: 0x40000 as *mut i32,
        topk_idx_len: 4,
        ..forward_args()
    };
    for dtype in [2, 5, -1] {
        let f = ForwardArgs {
            topk_idx_dtype: dtype,
            ..base
        };
        let got = unsafe { moe_routing_forward(&c, &f, null_mut()) };
        assert_eq!(got, INVALID_CONFIG, "dtype {dtype}");
    }
    let f = ForwardArgs {
        reserved2: 1,
        ..base
    };
    assert_eq!(
        unsafe { moe_routing_forward(&c, &f, null_mut()) },
        INVALID_CONFIG
    );
    // K = 8 needs 8 indices: 4 are too few whatever their dtype (checked before the device).
    for dtype in [0, 3, 4] {
        let f = ForwardArgs {
            topk_idx_dtype: dtype,
            ..base
        };
        let got = unsafe { moe_routing_forward(&c, &f, null_mut()) };
        assert_eq!(got, BUFFER_TOO_SMALL, "dtype {dtype}");
    }
    let v3 = ForwardArgs {
        struct_size: 152,
        topk_idx_dtype: 99,
        reserved2: 7,
        ..base
    };
    let got = unsafe { moe_routing_forward(&c, &v3, null_mut()) };
    assert_eq!(got, BUFFER_TOO_SMALL, "third-release struct: {got}");
}

/// Valid backward arguments in host memory for `tokens` tokens (a device-pass error at most).
fn host_backward_args(host: &[u8], tokens: i64) -> BackwardArgs {
    let c = glm();
    let (h, e, k) = (c.hidden_size, c.n_routed_experts, c.num_experts_per_tok);
    let base = (host.as_ptr() as u64).div_ceil(256) * 256;
    let at = |slot: u64| base + slot * 256;
    BackwardArgs {
        tokens,
        x: at(0) as *const u16,
        x_len: tokens * h,
        w: at(1) as *const u16,
        w_len: e * h,
        topk_idx: at(2) as *const i32,
        topk_idx_len: tokens * k,
        topk_scores: at(3) as *const f32,
        topk_scores_len: tokens * k,
        grad_topk_weights: at(4) as *const f32,
        grad_topk_weights_len: tokens * k,
        grad_x: at(5) as *mut u16,
        grad_x_len: tokens * h,
        grad_w: at(6) as *mut f32,
        grad_w_len: e * h,
        workspace: at(7) as *mut c_void,
        workspace_bytes: unsafe { moe_routing_backward_workspace_bytes(&c, tokens) } as i64,
        ..backward_args()
    }
}

#[test]
fn backward_dtypes_are_checked_before_cuda() {
    const F32: i32 = 1;
    const BF16: i32 = 2;
    const I32: i32 = 3;
    const I64: i32 = 4;
    let c = glm();
    let host = vec![0u8; 16 * 256];
    let good = host_backward_args(&host, 7);
    let device_pass = |status: i32| status == CUDA_ERROR || status == FOREIGN_POINTER;
    let call = |b: &BackwardArgs| unsafe { moe_routing_backward(&c, b, null_mut()) };
    assert!(device_pass(call(&good)));
    // The first release's struct: its declared dtypes, the appended fields not read.
    let v1 = BackwardArgs {
        struct_size: 152,
        topk_idx_dtype: 99,
        ..host_backward_args(&host, 7)
    };
    assert!(device_pass(call(&v1)));
    let with_dtypes = |(idx, sc, g, gw): (i32, i32, i32, i32)| BackwardArgs {
        topk_idx_dtype: idx,
        scores_dtype: sc,
        grad_topk_weights_dtype: g,
        grad_w_dtype: gw,
        ..host_backward_args(&host, 7)
    };
    // Each accepted dtype, and the declared ones named.
    for d in [
        (I32, F32, F32, F32),
        (I64, BF16, BF16, BF16),
        (0, BF16, 0, BF16),
    ] {
        assert!(device_pass(call(&with_dtypes(d))), "{d:?}");
    }
    // Dtypes a field does not take.
    for d in [
        (F32, 0, 0, 0),
        (BF16, 0, 0, 0),
        (5, 0, 0, 0),
        (-1, 0, 0, 0),
        (0, I64, 0, 0),
        (0, 0, I32, 0),
        (0, 0, 0, I64),
    ] {
        assert_eq!(call(&with_dtypes(d)), INVALID_CONFIG, "{d:?}");
    }
    // The scores in one form only.
    let both = BackwardArgs {
        scores: host.as_ptr().cast(),
        scores_len: 7 * c.n_routed_experts,
        ..host_backward_args(&host, 7)
    };
    assert_eq!(call(&both), INVALID_CONFIG);
    // All experts' scores: [T, E] elements, in place of the chosen ones.
    let all = BackwardArgs {
        topk_scores: null(),
        topk_scores_len: 0,
        scores_len: 7 * c.n_routed_experts - 1,
        ..both
    };
    assert_eq!(call(&all), BUFFER_TOO_SMALL);
    assert!(device_pass(call(&BackwardArgs {
        scores_len: 7 * c.n_routed_experts,
        ..all
    })));
    // int64 indices are 8-byte aligned.
    let b = BackwardArgs {
        topk_idx_dtype: I64,
        topk_idx: unsafe { good.topk_idx.byte_add(4) },
        ..host_backward_args(&host, 7)
    };
    assert_eq!(call(&b), MISALIGNED);
    // bf16 grad_w is written: neither accumulated nor precise.
    for (accumulate, precision) in [(1, 0), (0, 1)] {
        let b = BackwardArgs {
            grad_w_dtype: BF16,
            accumulate_grad_w: accumulate,
            precision,
            ..host_backward_args(&host, 7)
        };
        assert_eq!(call(&b), UNSUPPORTED);
    }
}

#[test]
fn workspace_size() {
    let c = glm();
    let bytes = unsafe { moe_routing_backward_workspace_bytes(&c, 256) };
    // 2 KB of counters, then 256-byte aligned scratch.
    assert!(bytes > 2048 && bytes % 256 == 0, "{bytes}");
    assert!(unsafe { moe_routing_backward_workspace_bytes(&c, 4096) } > bytes);
    assert_eq!(unsafe { moe_routing_backward_workspace_bytes(&c, 0) }, 0);
    assert_eq!(unsafe { moe_routing_backward_workspace_bytes(&c, -1) }, 0);
    assert_eq!(
        unsafe { moe_routing_backward_workspace_bytes(null(), 256) },
        0
    );
    let bad = Config { n_group: 7, ..c };
    assert_eq!(
        unsafe { moe_routing_backward_workspace_bytes(&bad, 256) },
        0
    );
}

#[test]
fn null_and_malformed_arguments_are_rejected_before_cuda() {
    let c = glm();
    let (f, b) = (forward_args(), backward_args());
    unsafe {
        assert_eq!(moe_routing_validate_config(null()), NULL_POINTER);
        assert_eq!(moe_routing_forward(&c, null(), null_mut()), NULL_POINTER);
        assert_eq!(moe_routing_forward(null(), &f, null_mut()), NULL_POINTER);
        assert_eq!(moe_routing_backward(&c, null(), null_mut()), NULL_POINTER);
        assert_eq!(moe_routing_backward(null(), &b, null_mut()), NULL_POINTER);
        // A malformed config is reported before the arguments are looked at.
        let bad = Config { reserved: 7, ..c };
        assert_eq!(
            moe_routing_forward(&bad, null(), null_mut()),
            INVALID_CONFIG
        );
        for (precision, accumulate) in [(3, 0), (-1, 0), (0, 2)] {
            let b = BackwardArgs {
                precision,
                accumulate_grad_w: accumulate,
                ..backward_args()
            };
            assert_eq!(moe_routing_backward(&c, &b, null_mut()), INVALID_CONFIG);
        }
    }
}

#[test]
fn device_count_agrees_with_the_crate() {
    let n = unsafe { moe_routing_device_count() };
    assert!(n >= 0);
    assert_eq!(n as usize, moe_routing::cuda_device_count());
}

/// One buffer argument of the property test: what the shape needs, and what was passed.
#[derive(Clone, Copy, Debug)]
struct Arg {
    need: i64,
    align: u64,
    ptr: u64,
    len: i64,
}

impl Arg {
    /// Random argument for a buffer of `need` elements aligned to `align` bytes: usually
    /// well-formed, sometimes null, misaligned or short. Addresses point into `host` (host
    /// memory, never device memory, so the device pass always rejects them) and are never
    /// dereferenced.
    fn random(
        rng: &mut moe_routing_dev::testing::Rng,
        host: &[u8],
        need: i64,
        align: u64,
        slot: u64,
    ) -> Self {
        let base = (host.as_ptr() as u64).div_ceil(256) * 256 + slot * 256;
        let (ptr, len) = match rng.below(10) {
            0 => (0, need),
            1 => (base + 4 * (1 + rng.below(3) as u64) % align.max(8), need),
            2 => (base, need - 1 - rng.below(4) as i64),
            _ => (base, need + rng.below(3) as i64),
        };
        Self {
            need,
            align,
            ptr,
            len,
        }
    }

    /// The status pass 1 of the validation gives this argument (0: it passes).
    fn expected(&self) -> i32 {
        if self.need == 0 {
            0
        } else if self.ptr == 0 {
            NULL_POINTER
        } else if self.ptr % self.align != 0 {
            MISALIGNED
        } else if self.len < self.need {
            BUFFER_TOO_SMALL
        } else {
            0
        }
    }
}

/// Random argument sets through the C ABI: every host-visible error is reported exactly (the
/// first bad buffer in argument order), and a well-formed set of host addresses never passes
/// the device check, so nothing is launched.
#[test]
fn random_arguments_get_the_first_error_and_never_launch() {
    let mut rng = moe_routing_dev::testing::Rng::new(0xA11CE);
    let c = glm();
    let (h, e, k) = (c.hidden_size, c.n_routed_experts, c.num_experts_per_tok);
    // Without a GPU the device pass cannot start (CUDA error); with one, the fake addresses
    // are not device memory (foreign pointer).
    let device_pass = |status: i32| status == CUDA_ERROR || status == FOREIGN_POINTER;
    let host = vec![0u8; 16 * 256];
    for round in 0..4000 {
        let tokens = [0i64, 1, 7, 129, 3001][rng.below(5)];
        let t_or_0 = |n: i64| if tokens == 0 { 0 } else { n };
        // One random buffer per (elements needed, alignment), in argument order.
        let mut args = |spec: &[(i64, u64)]| -> Vec<Arg> {
            spec.iter()
                .enumerate()
                .map(|(i, &(need, align))| Arg::random(&mut rng, &host, need, align, i as u64))
                .collect()
        };
        if round % 2 == 0 {
            let a = args(&[
                (tokens * h, 16),
                (t_or_0(e * h), 16),
                (t_or_0(e), 4),
                (tokens * k, 4),
                (tokens * k, 4),
                (tokens * k, 4),
            ]);
            let f = ForwardArgs {
                tokens,
                x: a[0].ptr as *const u16,
                x_len: a[0].len,
                w: a[1].ptr as *const u16,
                w_len: a[1].len,
                bias: a[2].ptr as *const f32,
                bias_len: a[2].len,
                topk_idx: a[3].ptr as *mut i32,
                topk_idx_len: a[3].len,
                topk_weights: a[4].ptr as *mut f32,
                topk_weights_len: a[4].len,
                topk_scores: a[5].ptr as *mut f32,
                topk_scores_len: a[5].len,
                ..forward_args()
            };
            let got = unsafe { moe_routing_forward(&c, &f, null_mut()) };
            match a.iter().map(Arg::expected).find(|&s| s != 0) {
                Some(want) => assert_eq!(got, want, "forward {a:?}"),
                None if tokens == 0 => assert!(got == SUCCESS || device_pass(got), "{got}"),
                None => assert!(device_pass(got), "forward {a:?}: {got}"),
            }
        } else {
            let ws = unsafe { moe_routing_backward_workspace_bytes(&c, tokens) } as i64;
            let a = args(&[
                (tokens * h, 16),
                (t_or_0(e * h), 16),
                (tokens * k, 4),
                (tokens * k, 4),
                (tokens * k, 4),
                (tokens * h, 16),
                (e * h, 16),
                (ws, 256),
            ]);
            let b = BackwardArgs {
                tokens,
                x: a[0].ptr as *const u16,
                x_len: a[0].len,
                w: a[1].ptr as *const u16,
                w_len: a[1].len,
                topk_idx: a[2].ptr as *const i32,
                topk_idx_len: a[2].len,
                topk_scores: a[3].ptr as *const f32,
                topk_scores_len: a[3].len,
                grad_topk_weights: a[4].ptr as *const f32,
                grad_topk_weights_len: a[4].len,
                grad_x: a[5].ptr as *mut u16,
                grad_x_len: a[5].len,
                grad_w: a[6].ptr as *mut f32,
                grad_w_len: a[6].len,
                workspace: a[7].ptr as *mut c_void,
                workspace_bytes: a[7].len,
                ..backward_args()
            };
            let got = unsafe { moe_routing_backward(&c, &b, null_mut()) };
            match a.iter().map(Arg::expected).find(|&s| s != 0) {
                Some(want) => assert_eq!(got, want, "backward {a:?}"),
                None => assert!(device_pass(got), "backward {a:?}: {got}"),
            }
        }
    }
}

#[test]
fn checked_device_flags() {
    // Unknown flag bits, a negative device with MOE_ROUTING_FLAG_CHECKED_DEVICE, or a device
    // without it are refused before anything else; with the flag the host checks still run
    // (here a missing x: NULL_POINTER, with or without a GPU). The second release's structs
    // (144 and 184 bytes) end before the flags, which are then not read.
    let c = glm();
    let call = |size: Option<(u32, u32)>, flags: u32, device: i32| {
        let f = ForwardArgs {
            tokens: 4,
            flags,
            device,
            ..forward_args()
        };
        let b = BackwardArgs {
            tokens: 4,
            flags,
            device,
            ..backward_args()
        };
        let (f, b) = match size {
            Some((fs, bs)) => (
                ForwardArgs {
                    struct_size: fs,
                    ..f
                },
                BackwardArgs {
                    struct_size: bs,
                    ..b
                },
            ),
            None => (f, b),
        };
        unsafe {
            [
                moe_routing_forward(&c, &f, null_mut()),
                moe_routing_backward(&c, &b, null_mut()),
            ]
        }
    };
    for (flags, device) in [(2, 0), (1 | 4, 0), (1, -1), (0, 3)] {
        let what = format!("flags {flags}, device {device}");
        assert_eq!(call(None, flags, device), [INVALID_CONFIG; 2], "{what}");
    }
    for device in [0, 7] {
        assert_eq!(call(None, 1, device), [NULL_POINTER; 2], "device {device}");
    }
    assert_eq!(call(Some((144, 184)), 2, 0), [NULL_POINTER; 2]);
}

#[test]
fn kernel_paths() {
    // MOE_ROUTING_PATH_FORWARD_FUSED | MOE_ROUTING_PATH_BACKWARD_FUSED, per config: the fused
    // kernels' expert counts (cpp/src/fused_kernels.def: 64, 128, 160, 256; the wide backward's
    // 272-512 at K <= 16), K (forward <= 16, backward <= 8 up to 256 experts, unless
    // MOE_ROUTING_WIDE_BACKWARD=1) and H
    // (backward: a multiple of 128 where E has 128-column kernels, else of 64, at most 256
    // slices).
    let paths = |c: &Config| {
        let mut p = u32::MAX;
        let status = unsafe { moe_routing_kernel_paths(c, &mut p) };
        (status, p)
    };
    let cases: [(i64, i64, i64, i64, u32); 12] = [
        (160, 8, 8, 5120, 3),
        (256, 8, 8, 7168, 3),
        (64, 6, 1, 2048, 3),
        (128, 8, 8, 4096, 3),
        (160, 12, 8, 5120, 1), // top-12: the fused forward, the simple backward
        (160, 8, 8, 5184, 1),  // H % 128 = 64: the 128-column E take the simple backward
        (256, 8, 8, 5184, 3),  // ... and 256, with 64-column kernels alone, the fused one
        (256, 8, 8, 64 * 257, 1), // 257 slices
        (384, 8, 1, 7168, 3),  // Kimi-K2's 384 experts: both fused (the wide backward)
        (512, 16, 8, 4096, 3), // 512 experts, top-16: likewise
        (96, 6, 1, 5120, 1),   // 96 experts: the 128-expert forward, masked
        (72, 6, 1, 5120, 0),   // not a multiple of 16: both simple
    ];
    for (e, k, g, h, want) in cases {
        let c = Config {
            n_routed_experts: e,
            num_experts_per_tok: k,
            n_group: g,
            topk_group: g.min(4),
            hidden_size: h,
            ..glm()
        };
        assert_eq!(
            paths(&c),
            (SUCCESS, want),
            "E {e}, K {k}, groups {g}, H {h}"
        );
    }
    let bad = Config {
        n_group: 7,
        ..glm()
    };
    assert_eq!(paths(&bad).0, INVALID_CONFIG);
    assert_eq!(
        unsafe { moe_routing_kernel_paths(&glm(), null_mut()) },
        NULL_POINTER
    );
}

#[test]
fn cuda_errors_carry_the_runtime_text() {
    let last = || {
        let p = unsafe { moe_routing_last_cuda_error() };
        assert!(!p.is_null());
        unsafe { CStr::from_ptr(p) }.to_str().unwrap().to_owned()
    };
    // Per thread, empty until a call of that thread fails in the CUDA runtime.
    assert_eq!(std::thread::spawn(last).join().unwrap(), "");
    // Host buffers: without a GPU the runtime's device query fails (no device, no driver); with
    // one the buffers are foreign. A CUDA error names the runtime's error and describes it.
    let c = glm();
    let host = vec![0u8; 16 * 256];
    let status = unsafe { moe_routing_backward(&c, &host_backward_args(&host, 7), null_mut()) };
    assert!(
        status == CUDA_ERROR || status == FOREIGN_POINTER,
        "status {status}"
    );
    if status == CUDA_ERROR {
        let text = last();
        assert!(
            text.starts_with("cudaError") && text.contains(": "),
            "{text:?}"
        );
        // Like errno: a later call that succeeds leaves it.
        assert_eq!(unsafe { moe_routing_validate_config(&c) }, SUCCESS);
        assert_eq!(last(), text);
    }
}
