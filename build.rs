//! Builds the CUDA kernels (nvcc, sm_90a) and the cxx bridge, and links cudart statically.
//!
//! Toolchain discovery, in order: `CUDA_HOME` / `CUDA_PATH`, then `nvcc` on `PATH`, then the
//! versions pinned in `third_party/cuda-toolchain.txt`, installed once from PyPI into a cache
//! outside the source tree. CUTLASS likewise: `CUTLASS_DIR`, else `third_party/cutlass.txt`.
//! No GPU is needed to build.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const GENCODE: &str = "-gencode=arch=compute_90a,code=sm_90a";

fn main() {
    for var in [
        "CUDA_HOME",
        "CUDA_PATH",
        "CUTLASS_DIR",
        "MOE_ROUTING_CACHE",
        "XDG_CACHE_HOME",
        "NVCC_CCBIN",
        "MOE_ROUTING_NVCC_FLAGS",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    for path in ["build.rs", "cpp", "third_party", "src/bridge.rs"] {
        println!("cargo:rerun-if-changed={path}");
    }

    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    let cuda = find_cuda(&manifest);
    let cutlass = find_cutlass(&manifest);
    let cuda_include = cuda.join("include");
    let cuda_lib = ["lib64", "lib", "targets/x86_64-linux/lib"]
        .iter()
        .map(|d| cuda.join(d))
        .find(|d| d.join("libcudart_static.a").exists())
        .unwrap_or_else(|| panic!("libcudart_static.a not found under {}", cuda.display()));

    // Device code and host launchers: every .cu under cpp/src, compiled in parallel.
    let mut sources: Vec<PathBuf> = std::fs::read_dir(manifest.join("cpp/src"))
        .expect("cpp/src")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    sources.sort();
    let nvcc = cuda.join("bin/nvcc");
    let extra: Vec<String> = env::var("MOE_ROUTING_NVCC_FLAGS")
        .map(|s| s.split_whitespace().map(String::from).collect())
        .unwrap_or_default();
    let objects: Vec<PathBuf> = std::thread::scope(|scope| {
        let handles: Vec<_> = sources
            .iter()
            .map(|src| {
                let obj = out.join(src.file_stem().unwrap()).with_extension("o");
                let mut cmd = Command::new(&nvcc);
                cmd.args([
                    "-std=c++17",
                    "-O3",
                    GENCODE,
                    "-DNDEBUG",
                    "--expt-relaxed-constexpr",
                ])
                .args(["-Xcompiler", "-fPIC", "-c"])
                .arg("-I")
                .arg(manifest.join("cpp/include"))
                .arg("-I")
                .arg(manifest.join("cpp"))
                .arg("-I")
                .arg(&cutlass)
                .args(&extra)
                .arg(src)
                .arg("-o")
                .arg(&obj);
                if let Ok(ccbin) = env::var("NVCC_CCBIN") {
                    cmd.arg("-ccbin").arg(ccbin);
                }
                scope.spawn(move || {
                    let status = cmd.status().expect("failed to run nvcc");
                    assert!(status.success(), "nvcc failed on {}", src.display());
                    obj
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });

    // One static archive of the CUDA code: linked into the crate, and the core of the
    // C++ consumers' library.
    let lib = out.join("libmoe_routing_cuda.a");
    let _ = std::fs::remove_file(&lib);
    let status = Command::new("ar")
        .arg("crs")
        .arg(&lib)
        .args(&objects)
        .status()
        .expect("failed to run ar");
    assert!(status.success(), "ar failed");

    cxx_build::bridge("src/bridge.rs")
        .file("cpp/bridge/bridge.cc")
        .include(manifest.join("cpp/include"))
        .include(manifest.join("cpp"))
        .include(&cuda_include)
        .std("c++17")
        .flag_if_supported("-Wno-unused-parameter")
        .compile("moe_routing_bridge");

    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-link-lib=static=moe_routing_cuda");
    println!("cargo:rustc-link-search=native={}", cuda_lib.display());
    println!("cargo:rustc-link-lib=static=cudart_static");
    for l in ["stdc++", "dl", "rt", "pthread"] {
        println!("cargo:rustc-link-lib=dylib={l}");
    }
    println!("cargo:include={}", manifest.join("cpp/include").display());
    println!("cargo:cuda_home={}", cuda.display());
    println!("cargo:cutlass_include={}", cutlass.display());
}

fn cache_dir() -> PathBuf {
    if let Ok(d) = env::var("MOE_ROUTING_CACHE") {
        return PathBuf::from(d);
    }
    if let Ok(d) = env::var("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("moe-routing");
    }
    let home = env::var("HOME").unwrap_or_else(|_| "/tmp".into());
    PathBuf::from(home).join(".cache/moe-routing")
}

fn find_cuda(manifest: &Path) -> PathBuf {
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(dir) = env::var(var) {
            let dir = PathBuf::from(dir);
            if dir.join("bin/nvcc").exists() {
                return dir;
            }
            println!(
                "cargo:warning={var}={} has no bin/nvcc; ignoring it",
                dir.display()
            );
        }
    }
    if let Some(path) = env::var_os("PATH") {
        for dir in env::split_paths(&path) {
            let nvcc = dir.join("nvcc");
            if nvcc.is_file() {
                let real = std::fs::canonicalize(&nvcc).unwrap_or(nvcc);
                return real.parent().unwrap().parent().unwrap().to_path_buf();
            }
        }
    }
    let root = provision(manifest, "cuda-toolchain.txt", false);
    root.join("nvidia/cu13")
}

fn find_cutlass(manifest: &Path) -> PathBuf {
    if let Ok(dir) = env::var("CUTLASS_DIR") {
        let dir = PathBuf::from(dir);
        for cand in [dir.join("include"), dir.clone()] {
            if cand.join("cutlass/cutlass.h").exists() && cand.join("cute/tensor.hpp").exists() {
                return cand;
            }
        }
        panic!(
            "CUTLASS_DIR={} holds neither include/cutlass nor cutlass/",
            dir.display()
        );
    }
    provision(manifest, "cutlass.txt", true).join("cutlass_library/source/include")
}

/// Installs the pinned requirements file `third_party/<file>` from PyPI into a cache folder
/// keyed by the file's content, once, and returns that folder.
fn provision(manifest: &Path, file: &str, no_deps: bool) -> PathBuf {
    let req = manifest.join("third_party").join(file);
    let text = std::fs::read_to_string(&req).expect("third_party pin file");
    let pins: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let key = fnv1a(pins.join("\n").as_bytes());
    let stem = file.trim_end_matches(".txt");
    let dir = cache_dir().join(format!("{stem}-{key:016x}"));
    if dir.join(".complete").exists() {
        return dir;
    }
    println!(
        "cargo:warning=moe-routing: installing {} from PyPI into {} (once)",
        pins.join(" "),
        dir.display()
    );
    let staging = dir.with_extension(format!("partial-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging).expect("create cache dir");
    let python = env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let mut cmd = Command::new(python);
    cmd.args([
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
    ])
    .args(["--no-warn-script-location", "--target"])
    .arg(&staging);
    if no_deps {
        cmd.arg("--no-deps");
    }
    let status = cmd
        .args(&pins)
        .status()
        .expect("failed to run python3 -m pip");
    assert!(
        status.success(),
        "pip could not install {pins:?}; set CUDA_HOME / CUTLASS_DIR to existing installs instead"
    );
    std::fs::write(staging.join(".complete"), pins.join("\n")).unwrap();
    // Another build may have finished first: keep whichever landed.
    if std::fs::rename(&staging, &dir).is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    dir
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100000001b3)
    })
}
