//! Builds the CUDA kernels (nvcc, sm_90a) and the cxx bridge, and links the CUDA runtime
//! statically. No GPU is needed to build. One module per job:
//!
//! - [`toolchain`]: finds nvcc and CUTLASS, or provisions the pinned ones from PyPI;
//! - [`kernels`]: the translation units, one per fused kernel of `cpp/src/fused_kernels.def`;
//! - [`nvcc`]: compiles them in parallel, recompiling only what changed, into one archive.
//!
//! It writes only into `OUT_DIR`. The package for C and C++ consumers is laid out by a step of
//! its own, `cargo xtask package` (xtask/), from the `package.txt` this writes there.

mod kernels;
mod nvcc;
mod toolchain;

use std::env;
use std::path::{Path, PathBuf};

fn main() {
    for var in [
        "CUDA_HOME",
        "CUDA_PATH",
        "CUTLASS_DIR",
        "MOE_ROUTING_CACHE",
        "MOE_ROUTING_PROVISION",
        "XDG_CACHE_HOME",
        "NVCC_CCBIN",
        "MOE_ROUTING_NVCC_FLAGS",
        "MOE_ROUTING_NVCC_JOBS",
        "PYTHON",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    for path in ["build", "cpp", "third_party", "src/bridge.rs"] {
        println!("cargo:rerun-if-changed={path}");
    }

    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    check_version(&manifest);
    let cuda = toolchain::Cuda::find(&manifest);
    let cutlass = toolchain::find_cutlass(&manifest);

    let flags = nvcc::Flags::read(&manifest);
    let units = kernels::units(&manifest);
    let objects = nvcc::compile(&nvcc::Job {
        nvcc: &cuda.nvcc(),
        flags: &flags,
        includes: &[
            manifest.join("cpp/include"),
            manifest.join("cpp"),
            cutlass.clone(),
        ],
        units: &units,
        out: &out,
    });
    // One static archive of the CUDA code: linked into the crate, and the core of the
    // C++ consumers' library.
    nvcc::archive(&out.join("libmoe_routing_cuda.a"), &objects);

    cxx_build::bridge("src/bridge.rs")
        .file("cpp/bridge/bridge.cc")
        .include(manifest.join("cpp/include"))
        .include(manifest.join("cpp"))
        .include(cuda.include())
        .std("c++17")
        .flag_if_supported("-Wno-unused-parameter")
        .compile("moe_routing_bridge");

    // What `cargo xtask package` lays the C/C++ package out from.
    let mut inputs = format!(
        "version={}\ncuda_include={}\ncudart_static={}\n",
        env::var("CARGO_PKG_VERSION").unwrap(),
        cuda.include().display(),
        cuda.cudart_static().display()
    );
    for obj in &objects {
        inputs += &format!("object={}\n", obj.display());
    }
    std::fs::write(out.join("package.txt"), inputs).expect("write package.txt");

    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-link-lib=static=moe_routing_cuda");
    println!(
        "cargo:rustc-link-search=native={}",
        cuda.cudart_static().parent().unwrap().display()
    );
    println!("cargo:rustc-link-lib=static=cudart_static");
    for l in ["stdc++", "dl", "rt", "pthread"] {
        println!("cargo:rustc-link-lib=dylib={l}");
    }
    println!("cargo:include={}", manifest.join("cpp/include").display());
    println!("cargo:cuda_home={}", cuda.root.display());
    println!("cargo:cutlass_include={}", cutlass.display());
    // Every .cu's nvcc flags (cpp/nvcc.flags and MOE_ROUTING_NVCC_FLAGS), for dependents that
    // compile CUDA against these headers (the benches' baselines).
    println!("cargo:nvcc_flags={}", flags.all().join(" "));
}

/// The C headers' version is the crate's.
fn check_version(manifest: &Path) {
    let header = manifest.join("cpp/include/moe_routing/moe_routing.h");
    let text = std::fs::read_to_string(&header).expect("moe_routing.h");
    let declared = text
        .lines()
        .find_map(|l| l.strip_prefix("#define MOE_ROUTING_VERSION_STRING "))
        .map(|v| v.trim().trim_matches('"').to_string());
    assert_eq!(
        declared.as_deref(),
        Some(env::var("CARGO_PKG_VERSION").unwrap().as_str()),
        "MOE_ROUTING_VERSION_STRING in {} must equal the crate version",
        header.display()
    );
}
