//! Builds the baselines' CUDA code (cpp/baseline.cu) with the toolchain, CUTLASS and nvcc flags
//! the library was built with (its build script's `cargo:` metadata), and their cxx bridge.

use std::env;
use std::path::PathBuf;
use std::process::Command;

fn dep(key: &str) -> PathBuf {
    let var = format!("DEP_MOE_ROUTING_{key}");
    PathBuf::from(env::var(&var).unwrap_or_else(|_| panic!("{var}: set by moe-routing's build")))
}

fn main() {
    for path in [
        "build.rs",
        "src/lib.rs",
        "cpp",
        "../cpp/src",
        "../cpp/kernels",
        "../cpp/bridge",
    ] {
        println!("cargo:rerun-if-changed={path}");
    }
    println!("cargo:rerun-if-env-changed=NVCC_CCBIN");
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let root = manifest.parent().expect("the repository").to_path_buf();
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let (cuda, cutlass, include) = (dep("CUDA_HOME"), dep("CUTLASS_INCLUDE"), dep("INCLUDE"));

    let flags = env::var("DEP_MOE_ROUTING_NVCC_FLAGS")
        .expect("DEP_MOE_ROUTING_NVCC_FLAGS: set by moe-routing's build");
    let obj = out.join("baseline.o");
    let mut nvcc = Command::new(cuda.join("bin/nvcc"));
    nvcc.args(flags.split_whitespace())
        .arg("-c")
        .arg("-I")
        .arg(&include)
        .arg("-I")
        .arg(root.join("cpp"))
        .arg("-I")
        .arg(&cutlass)
        .arg(manifest.join("cpp/baseline.cu"))
        .arg("-o")
        .arg(&obj);
    if let Ok(ccbin) = env::var("NVCC_CCBIN") {
        nvcc.arg("-ccbin").arg(ccbin);
    }
    let status = nvcc.status().expect("failed to run nvcc");
    assert!(status.success(), "nvcc failed on cpp/baseline.cu");
    let lib = out.join("libmoe_routing_dev.a");
    let _ = std::fs::remove_file(&lib);
    let status = Command::new("ar")
        .arg("crs")
        .arg(&lib)
        .arg(&obj)
        .status()
        .expect("failed to run ar");
    assert!(status.success(), "ar failed");

    cxx_build::bridge("src/lib.rs")
        .file("cpp/baseline_bridge.cc")
        .include(&include)
        .include(root.join("cpp"))
        .include(manifest.join("cpp"))
        .include(cuda.join("include"))
        .std("c++17")
        .flag_if_supported("-Wno-unused-parameter")
        .compile("moe_routing_dev_bridge");
    // Before the library's archive, whose symbols the baselines use.
    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-link-lib=static=moe_routing_dev");
}
