//! Builds the CUDA kernels (nvcc, sm_90a) and the cxx bridge, and links cudart statically.
//!
//! Toolchain discovery, in order: `CUDA_HOME` / `CUDA_PATH`, then `nvcc` on `PATH`, then the
//! versions pinned in `third_party/cuda-toolchain.txt`, installed once from PyPI into a cache
//! outside the source tree. CUTLASS likewise: `CUTLASS_DIR`, else `third_party/cutlass.txt`.
//! No GPU is needed to build.
//!
//! It also lays out the package for C and C++ consumers in `target/<profile>/moe_routing/`
//! (see [`package`]).

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

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
    // The flags, one per line (# comments), shared with CMakeLists.txt.
    let flags: Vec<String> = std::fs::read_to_string(manifest.join("cpp/nvcc.flags"))
        .expect("cpp/nvcc.flags")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect();
    let extra: Vec<String> = env::var("MOE_ROUTING_NVCC_FLAGS")
        .map(|s| s.split_whitespace().map(String::from).collect())
        .unwrap_or_default();
    // At most `jobs` nvcc at once (cargo's job count, or MOE_ROUTING_NVCC_JOBS): one nvcc of a
    // fused kernel takes a few GB, and all of them at once exhaust a small machine's memory.
    let jobs = env::var("MOE_ROUTING_NVCC_JOBS")
        .or_else(|_| env::var("NUM_JOBS"))
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(2);
    // (object, nvcc command) per source.
    let commands: Vec<(PathBuf, Mutex<Command>)> = sources
        .iter()
        .map(|src| {
            let obj = out.join(src.file_stem().unwrap()).with_extension("o");
            let mut cmd = Command::new(&nvcc);
            cmd.args(&flags)
                .arg("-c")
                .arg("-I")
                .arg(manifest.join("cpp/include"))
                .arg("-I")
                .arg(manifest.join("cpp"))
                .arg("-I")
                .arg(&cutlass)
                .args(&extra)
                .arg(src)
                .arg("-o")
                .arg(&obj)
                // The headers it read, so that the next build can skip it when none changed.
                .arg("-MD")
                .arg("-MF")
                .arg(obj.with_extension("d"));
            if let Ok(ccbin) = env::var("NVCC_CCBIN") {
                cmd.arg("-ccbin").arg(ccbin);
            }
            (obj, Mutex::new(cmd))
        })
        .collect();
    let next = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..jobs.min(commands.len()) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some((obj, cmd)) = commands.get(i) else {
                    break;
                };
                let mut cmd = cmd.lock().unwrap();
                if up_to_date(obj, &cmd) {
                    continue;
                }
                let status = cmd.status().expect("failed to run nvcc");
                assert!(status.success(), "nvcc failed on {}", sources[i].display());
                // The command beside the object: another command (flags, toolchain) rebuilds.
                std::fs::write(obj.with_extension("cmd"), format!("{cmd:?}")).expect("write .cmd");
            });
        }
    });
    let objects: Vec<PathBuf> = commands.into_iter().map(|(obj, _)| obj).collect();

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

    package(&Package {
        manifest: &manifest,
        out: &out,
        objects: &objects,
        cuda_archive: &lib,
        cudart_static: &cuda_lib.join("libcudart_static.a"),
        cuda_include: &cuda_include,
    });

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
    // Every .cu's nvcc flags (cpp/nvcc.flags and MOE_ROUTING_NVCC_FLAGS), for dependents that
    // compile CUDA against these headers (the benches' baselines).
    println!("cargo:nvcc_flags={}", [flags, extra].concat().join(" "));
}

/// What [`package`] is made from.
struct Package<'a> {
    manifest: &'a Path,
    out: &'a Path,
    /// The nvcc objects (position independent).
    objects: &'a [PathBuf],
    /// `libmoe_routing_cuda.a`, the archive of `objects`.
    cuda_archive: &'a Path,
    cudart_static: &'a Path,
    cuda_include: &'a Path,
}

/// Lays out the package for C and C++ consumers in `target/<profile>/moe_routing/` (three
/// levels above `OUT_DIR`, so `CARGO_TARGET_DIR` and `--target` are followed):
///
/// ```text
/// include/moe_routing/{router.h, moe_routing.h}
/// lib/libmoe_routing.a          self-contained: the CUDA runtime (cudart_static) merged in;
///                               link with -lstdc++ -ldl -lrt -lpthread
/// lib/libmoe_routing.so.1       shared, soname libmoe_routing.so.1, CUDA runtime inside and
/// lib/libmoe_routing.so         hidden; exports the C ABI and the C++ API (-> .so.1)
/// lib/cmake/moe_routing/        moe_routingConfig.cmake, moe_routingConfigVersion.cmake:
///                               targets moe_routing::moe_routing, moe_routing::moe_routing_shared
/// lib/pkgconfig/                moe_routing.pc (static), moe_routing-shared.pc
/// ```
///
/// The config files locate everything relative to themselves, so the folder can be copied
/// anywhere; only the CUDA include directory (for `cuda_runtime_api.h`) is recorded as an
/// absolute path. Files are replaced one by one through renames, so a consumer never sees a
/// half-written file.
fn package(p: &Package) {
    let version = env::var("CARGO_PKG_VERSION").unwrap();
    let header = p.manifest.join("cpp/include/moe_routing/moe_routing.h");
    let header_text = std::fs::read_to_string(&header).expect("moe_routing.h");
    let declared = header_text
        .lines()
        .find_map(|l| l.strip_prefix("#define MOE_ROUTING_VERSION_STRING "))
        .map(|v| v.trim().trim_matches('"').to_string());
    assert_eq!(
        declared.as_deref(),
        Some(version.as_str()),
        "MOE_ROUTING_VERSION_STRING in {} must equal the crate version",
        header.display()
    );

    // OUT_DIR is <target>/<profile>/build/moe-routing-<hash>/out.
    let mut up = p.out.ancestors().skip(2);
    let pkg = match (up.next(), up.next()) {
        (Some(build), Some(profile)) if build.file_name() == Some("build".as_ref()) => {
            profile.join("moe_routing")
        }
        _ => {
            println!(
                "cargo:warning=moe-routing: OUT_DIR not under <profile>/build: no C/C++ package"
            );
            return;
        }
    };
    let (inc, lib) = (pkg.join("include/moe_routing"), pkg.join("lib"));
    for dir in [&inc, &lib.join("cmake/moe_routing"), &lib.join("pkgconfig")] {
        std::fs::create_dir_all(dir).expect("create package folders");
    }

    // Headers.
    for entry in std::fs::read_dir(p.manifest.join("cpp/include/moe_routing")).unwrap() {
        let src = entry.unwrap().path();
        if src.extension().is_some_and(|e| e == "h") {
            install(&src, &inc.join(src.file_name().unwrap()));
        }
    }

    // Static library: the CUDA objects and cudart_static in one archive (ar MRI script; names
    // relative to OUT_DIR, which MRI parses safely).
    std::fs::copy(p.cudart_static, p.out.join("cudart_static.a")).expect("copy cudart_static");
    let merged = p.out.join("libmoe_routing.a");
    let _ = std::fs::remove_file(&merged);
    let script = format!(
        "CREATE libmoe_routing.a\nADDLIB {}\nADDLIB cudart_static.a\nSAVE\nEND\n",
        p.cuda_archive.file_name().unwrap().to_str().unwrap()
    );
    std::fs::write(p.out.join("libmoe_routing.mri"), script).unwrap();
    run(Command::new("ar")
        .arg("-M")
        .current_dir(p.out)
        .stdin(std::fs::File::open(p.out.join("libmoe_routing.mri")).unwrap()));
    run(Command::new("ar").arg("s").arg(&merged));
    install(&merged, &lib.join("libmoe_routing.a"));

    // Shared library, linked by nvcc's host compiler if given (NVCC_CCBIN), else CXX or c++;
    // cxx-build's compiler detection already reruns the build when CXX changes.
    // The public symbols (a linker version script shared with CMakeLists.txt).
    let exports = p.manifest.join("cpp/libmoe_routing.exports");
    let shared = p.out.join("libmoe_routing.so.1");
    let cxx = env::var("NVCC_CCBIN")
        .or_else(|_| env::var("CXX"))
        .unwrap_or_else(|_| "c++".into());
    run(Command::new(cxx)
        .args(["-shared", "-fPIC", "-o"])
        .arg(&shared)
        .arg("-Wl,-soname,libmoe_routing.so.1")
        .arg(format!("-Wl,--version-script={}", exports.display()))
        .arg("-Wl,--no-undefined")
        .args(p.objects)
        .arg(p.cudart_static)
        .args(["-ldl", "-lrt", "-lpthread"]));
    install(&shared, &lib.join("libmoe_routing.so.1"));
    let link = lib.join("libmoe_routing.so");
    let tmp = lib.join(format!(".libmoe_routing.so.{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink("libmoe_routing.so.1", &tmp).expect("symlink libmoe_routing.so");
    std::fs::rename(&tmp, &link).expect("rename libmoe_routing.so");

    // CMake package and pkg-config files.
    let cuda_include = p.cuda_include.display().to_string();
    let fill = |t: &str| {
        t.replace("@VERSION@", &version)
            .replace("@CUDA_INCLUDE@", &cuda_include)
    };
    let cmake = lib.join("cmake/moe_routing");
    write(&cmake.join("moe_routingConfig.cmake"), &fill(CMAKE_CONFIG));
    write(
        &cmake.join("moe_routingConfigVersion.cmake"),
        &fill(CMAKE_VERSION),
    );
    write(&lib.join("pkgconfig/moe_routing.pc"), &fill(PC_STATIC));
    write(
        &lib.join("pkgconfig/moe_routing-shared.pc"),
        &fill(PC_SHARED),
    );
}

const CMAKE_CONFIG: &str = r#"# CMake package of moe-routing @VERSION@ (written by its build.rs).
#
#   find_package(moe_routing REQUIRED)
#   target_link_libraries(app PRIVATE moe_routing::moe_routing)         # static, self-contained
#   target_link_libraries(app PRIVATE moe_routing::moe_routing_shared)  # libmoe_routing.so.1
#
# Both carry the include directories of moe_routing and of CUDA (cuda_runtime_api.h). The
# static library holds the CUDA runtime (cudart_static), so its consumers can call the CUDA
# runtime API without linking cudart; the shared library keeps its CUDA runtime private, so
# consumers of it that call the CUDA runtime link one themselves (CUDA::cudart).
# Paths are relative to this file, so the package folder can be moved; the CUDA include
# directory is the one the library was built with, unless MOE_ROUTING_CUDA_INCLUDE_DIR is
# set, and CUDAToolkit's when neither holds cuda_runtime_api.h.

get_filename_component(_moe_routing_prefix "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
set(moe_routing_VERSION "@VERSION@")
set(moe_routing_ABI_VERSION 1)

set(_moe_routing_cuda_include "${MOE_ROUTING_CUDA_INCLUDE_DIR}")
if(NOT _moe_routing_cuda_include)
  set(_moe_routing_cuda_include "@CUDA_INCLUDE@")
endif()
if(NOT EXISTS "${_moe_routing_cuda_include}/cuda_runtime_api.h")
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND)
    set(_moe_routing_cuda_include "${CUDAToolkit_INCLUDE_DIRS}")
  else()
    set(moe_routing_FOUND FALSE)
    set(moe_routing_NOT_FOUND_MESSAGE
        "no cuda_runtime_api.h in ${_moe_routing_cuda_include}: \
set MOE_ROUTING_CUDA_INCLUDE_DIR to a CUDA include directory")
    return()
  endif()
endif()
foreach(_moe_routing_file include/moe_routing/router.h include/moe_routing/moe_routing.h
        lib/libmoe_routing.a lib/libmoe_routing.so.1)
  if(NOT EXISTS "${_moe_routing_prefix}/${_moe_routing_file}")
    set(moe_routing_FOUND FALSE)
    set(moe_routing_NOT_FOUND_MESSAGE "${_moe_routing_prefix}/${_moe_routing_file} is missing")
    return()
  endif()
endforeach()

include(CMakeFindDependencyMacro)
find_dependency(Threads)

set(moe_routing_INCLUDE_DIRS "${_moe_routing_prefix}/include" "${_moe_routing_cuda_include}")
set(moe_routing_CUDA_INCLUDE_DIR "${_moe_routing_cuda_include}")

if(NOT TARGET moe_routing::moe_routing)
  add_library(moe_routing::moe_routing STATIC IMPORTED)
  set_target_properties(moe_routing::moe_routing PROPERTIES
    IMPORTED_LOCATION "${_moe_routing_prefix}/lib/libmoe_routing.a"
    INTERFACE_INCLUDE_DIRECTORIES "${moe_routing_INCLUDE_DIRS}"
    INTERFACE_LINK_LIBRARIES "stdc++;${CMAKE_DL_LIBS};rt;Threads::Threads")
endif()
if(NOT TARGET moe_routing::moe_routing_shared)
  add_library(moe_routing::moe_routing_shared SHARED IMPORTED)
  set_target_properties(moe_routing::moe_routing_shared PROPERTIES
    IMPORTED_LOCATION "${_moe_routing_prefix}/lib/libmoe_routing.so.1"
    IMPORTED_SONAME "libmoe_routing.so.1"
    INTERFACE_INCLUDE_DIRECTORIES "${moe_routing_INCLUDE_DIRS}")
endif()
set(moe_routing_LIBRARIES moe_routing::moe_routing)
"#;

const CMAKE_VERSION: &str = r#"# Version of the moe_routing CMake package (written by build.rs).
# Before 1.0 a minor version is a major one: 0.1.x serves requests for 0.1.y with y <= x.
set(PACKAGE_VERSION "@VERSION@")
set(PACKAGE_VERSION_COMPATIBLE FALSE)
set(PACKAGE_VERSION_EXACT FALSE)
if(NOT PACKAGE_FIND_VERSION)
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
elseif(PACKAGE_FIND_VERSION VERSION_GREATER PACKAGE_VERSION)
  # newer than this
elseif(PACKAGE_VERSION MATCHES "^0\\.")
  if(PACKAGE_FIND_VERSION_MAJOR EQUAL 0 AND PACKAGE_FIND_VERSION MATCHES "^0\\.([0-9]+)")
    if(PACKAGE_VERSION MATCHES "^0\\.${CMAKE_MATCH_1}(\\.|$)")
      set(PACKAGE_VERSION_COMPATIBLE TRUE)
    endif()
  endif()
elseif(PACKAGE_VERSION MATCHES "^([0-9]+)\\.")
  if(PACKAGE_FIND_VERSION_MAJOR EQUAL CMAKE_MATCH_1)
    set(PACKAGE_VERSION_COMPATIBLE TRUE)
  endif()
endif()
if(PACKAGE_FIND_VERSION AND PACKAGE_FIND_VERSION VERSION_EQUAL PACKAGE_VERSION)
  set(PACKAGE_VERSION_EXACT TRUE)
endif()
# Built for 64-bit x86-64 Linux.
if(CMAKE_SIZEOF_VOID_P AND NOT CMAKE_SIZEOF_VOID_P EQUAL 8)
  set(PACKAGE_VERSION "${PACKAGE_VERSION} (64-bit)")
  set(PACKAGE_VERSION_UNSUITABLE TRUE)
endif()
"#;

const PC_STATIC: &str = r#"# moe-routing, static library with the CUDA runtime merged in.
prefix=${pcfiledir}/../..
includedir=${prefix}/include
libdir=${prefix}/lib
cuda_includedir=@CUDA_INCLUDE@

Name: moe_routing
Description: Grouped top-k MoE router for Hopper GPUs (static, CUDA runtime included)
Version: @VERSION@
Cflags: -I${includedir} -I${cuda_includedir}
Libs: ${libdir}/libmoe_routing.a -lstdc++ -ldl -lrt -lpthread
"#;

const PC_SHARED: &str = r#"# moe-routing, shared library (its CUDA runtime is private).
prefix=${pcfiledir}/../..
includedir=${prefix}/include
libdir=${prefix}/lib
cuda_includedir=@CUDA_INCLUDE@

Name: moe_routing-shared
Description: Grouped top-k MoE router for Hopper GPUs (shared library)
Version: @VERSION@
Cflags: -I${includedir} -I${cuda_includedir}
Libs: -L${libdir} -Wl,-rpath,${libdir} -lmoe_routing
"#;

/// Runs a packaging tool; any failure fails the build.
fn run(cmd: &mut Command) {
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("failed to run {cmd:?}: {e}"));
    assert!(status.success(), "{cmd:?} failed");
}

/// Replaces `dst` by a copy of `src` (through a rename, so readers never see half a file).
fn install(src: &Path, dst: &Path) {
    let tmp = temp_beside(dst);
    std::fs::copy(src, &tmp).unwrap_or_else(|e| panic!("copy {}: {e}", src.display()));
    std::fs::rename(&tmp, dst).unwrap_or_else(|e| panic!("rename to {}: {e}", dst.display()));
}

/// Replaces `dst` by `text` (through a rename).
fn write(dst: &Path, text: &str) {
    let tmp = temp_beside(dst);
    std::fs::write(&tmp, text).unwrap_or_else(|e| panic!("write {}: {e}", tmp.display()));
    std::fs::rename(&tmp, dst).unwrap_or_else(|e| panic!("rename to {}: {e}", dst.display()));
}

fn temp_beside(dst: &Path) -> PathBuf {
    let name = dst.file_name().unwrap().to_string_lossy();
    dst.with_file_name(format!(".{name}.{}", std::process::id()))
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

/// An object is up to date when it was built by the same command and is newer than every file
/// its dependency file (nvcc -MD) lists: a build that changes one kernel's headers recompiles
/// only the translation units that include them.
fn up_to_date(obj: &Path, cmd: &Command) -> bool {
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let (Some(built), Ok(deps), Ok(old_cmd)) = (
        modified(obj),
        std::fs::read_to_string(obj.with_extension("d")),
        std::fs::read_to_string(obj.with_extension("cmd")),
    ) else {
        return false;
    };
    if old_cmd != format!("{cmd:?}") {
        return false;
    }
    // A Make rule ("obj: dep dep \ <newline> dep ..."): every path after its target.
    deps.split_whitespace()
        .skip_while(|w| !w.ends_with(':'))
        .skip(1)
        .filter(|w| *w != "\\")
        .all(|w| modified(Path::new(w)).is_some_and(|m| m <= built))
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
