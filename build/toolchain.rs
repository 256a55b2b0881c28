//! The CUDA toolchain and CUTLASS: `CUDA_HOME` / `CUDA_PATH`, then `nvcc` on `PATH`; CUTLASS
//! from `CUTLASS_DIR`. Where none is given, the versions pinned in `third_party/` are installed
//! once from PyPI into a cache outside the source tree (`third_party/provision.py`, which the
//! CMake build uses too); `MOE_ROUTING_PROVISION=0` turns that off, and a missing toolchain is
//! then an error.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

pub struct Cuda {
    pub root: PathBuf,
}

impl Cuda {
    pub fn find(manifest: &Path) -> Cuda {
        for var in ["CUDA_HOME", "CUDA_PATH"] {
            if let Ok(dir) = env::var(var) {
                let dir = PathBuf::from(dir);
                if dir.join("bin/nvcc").exists() {
                    return Cuda { root: dir };
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
                    let root = real.parent().unwrap().parent().unwrap().to_path_buf();
                    return Cuda { root };
                }
            }
        }
        let root = provision(manifest, "cuda-toolchain.txt", false, "nvcc (CUDA_HOME)");
        Cuda {
            root: root.join("nvidia/cu13"),
        }
    }

    pub fn nvcc(&self) -> PathBuf {
        self.root.join("bin/nvcc")
    }

    pub fn include(&self) -> PathBuf {
        self.root.join("include")
    }

    pub fn cudart_static(&self) -> PathBuf {
        ["lib64", "lib", "targets/x86_64-linux/lib"]
            .iter()
            .map(|d| self.root.join(d).join("libcudart_static.a"))
            .find(|p| p.exists())
            .unwrap_or_else(|| panic!("libcudart_static.a not found under {}", self.root.display()))
    }
}

/// The CUTLASS include directory (holding `cutlass/` and `cute/`).
pub fn find_cutlass(manifest: &Path) -> PathBuf {
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
    provision(manifest, "cutlass.txt", true, "CUTLASS (CUTLASS_DIR)")
        .join("cutlass_library/source/include")
}

/// The cache folder holding the pinned requirements of `third_party/<file>`, installed from
/// PyPI on first use by `third_party/provision.py`.
fn provision(manifest: &Path, file: &str, no_deps: bool, what: &str) -> PathBuf {
    if env::var("MOE_ROUTING_PROVISION").is_ok_and(|v| v == "0") {
        panic!("{what} not found, and MOE_ROUTING_PROVISION=0 forbids installing {file}'s pins");
    }
    let python = env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let mut cmd = Command::new(&python);
    cmd.arg(manifest.join("third_party/provision.py")).arg(file);
    if no_deps {
        cmd.arg("--no-deps");
    }
    let output = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what} not found, and {python} failed to run: {e}"));
    // What it says (that it installs, or why it failed) as build warnings.
    for line in String::from_utf8_lossy(&output.stderr).lines() {
        println!("cargo:warning={line}");
    }
    assert!(
        output.status.success(),
        "{what} not found, and installing third_party/{file} failed"
    );
    PathBuf::from(
        String::from_utf8(output.stdout)
            .expect("provision.py output")
            .trim(),
    )
}
