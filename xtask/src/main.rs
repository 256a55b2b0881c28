//! Repository tasks, run as `cargo xtask <task>`.
//!
//! `package [--debug]`: builds the library (`cargo build --release`, or the dev profile) and
//! lays out the package for C and C++ consumers in `<target>/<profile>/moe_routing/`:
//!
//! ```text
//! include/moe_routing/{router.h, moe_routing.h}
//! lib/libmoe_routing.a          self-contained: the CUDA runtime (cudart_static) merged in;
//!                               link with -lstdc++ -ldl -lrt -lpthread
//! lib/libmoe_routing.so.1       shared, soname libmoe_routing.so.1, CUDA runtime inside and
//! lib/libmoe_routing.so         hidden; exports the C ABI and the C++ API (-> .so.1)
//! lib/cmake/moe_routing/        moe_routingConfig.cmake, moe_routingConfigVersion.cmake:
//!                               targets moe_routing::moe_routing, moe_routing::moe_routing_shared
//! lib/pkgconfig/                moe_routing.pc (static), moe_routing-shared.pc
//! ```
//!
//! The config files (templates in `cpp/package/`) locate everything relative to themselves, so
//! the folder can be copied anywhere; only the CUDA include directory (for `cuda_runtime_api.h`)
//! is recorded as an absolute path. Files are replaced one by one through renames, so a consumer
//! never sees a half-written file. The inputs are the library build's objects, listed by its
//! build script in `OUT_DIR/package.txt`.

use std::env;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};

fn main() -> ExitCode {
    let args: Vec<String> = env::args().skip(1).collect();
    let result = match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        ["package"] => package(true),
        ["package", "--debug"] => package(false),
        _ => Err("usage: cargo xtask package [--debug]".into()),
    };
    match result {
        Ok(pkg) => {
            println!("{}", pkg.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

type Result<T> = std::result::Result<T, String>;

/// What the library's build script lists in `OUT_DIR/package.txt`.
struct Inputs {
    out: PathBuf,
    /// The crate's, which the build checked the headers declare.
    version: String,
    cuda_include: String,
    cudart_static: PathBuf,
    objects: Vec<PathBuf>,
}

fn package(release: bool) -> Result<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf();
    let inputs = build(&root, release)?;

    // OUT_DIR is <target>/<profile>/build/moe-routing-<hash>/out.
    let pkg = inputs
        .out
        .ancestors()
        .nth(3)
        .ok_or("OUT_DIR not under <target>/<profile>/build")?
        .join("moe_routing");
    let (inc, lib) = (pkg.join("include/moe_routing"), pkg.join("lib"));
    for dir in [&inc, &lib.join("cmake/moe_routing"), &lib.join("pkgconfig")] {
        std::fs::create_dir_all(dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
    }

    // Headers.
    for entry in std::fs::read_dir(root.join("cpp/include/moe_routing")).map_err(io)? {
        let src = entry.map_err(io)?.path();
        if src.extension().is_some_and(|e| e == "h") {
            install(&src, &inc.join(src.file_name().unwrap()))?;
        }
    }

    // Static library: the CUDA objects and cudart_static in one archive (ar MRI script; names
    // relative to the staging folder, which MRI parses safely).
    let stage = inputs.out.join("package");
    let _ = std::fs::remove_dir_all(&stage);
    std::fs::create_dir_all(&stage).map_err(io)?;
    std::fs::copy(&inputs.cudart_static, stage.join("cudart_static.a")).map_err(io)?;
    std::fs::copy(
        inputs.out.join("libmoe_routing_cuda.a"),
        stage.join("cuda.a"),
    )
    .map_err(io)?;
    let script = "CREATE libmoe_routing.a\nADDLIB cuda.a\nADDLIB cudart_static.a\nSAVE\nEND\n";
    std::fs::write(stage.join("libmoe_routing.mri"), script).map_err(io)?;
    let mri = std::fs::File::open(stage.join("libmoe_routing.mri")).map_err(io)?;
    run(Command::new("ar").arg("-M").current_dir(&stage).stdin(mri))?;
    run(Command::new("ar")
        .arg("s")
        .arg(stage.join("libmoe_routing.a")))?;
    install(
        &stage.join("libmoe_routing.a"),
        &lib.join("libmoe_routing.a"),
    )?;

    // Shared library, linked by nvcc's host compiler if given (NVCC_CCBIN), else CXX or c++.
    // The public symbols: a linker version script shared with CMakeLists.txt.
    let exports = root.join("cpp/libmoe_routing.exports");
    let shared = stage.join("libmoe_routing.so.1");
    let cxx = env::var("NVCC_CCBIN")
        .or_else(|_| env::var("CXX"))
        .unwrap_or_else(|_| "c++".into());
    run(Command::new(cxx)
        .args(["-shared", "-fPIC", "-o"])
        .arg(&shared)
        .arg("-Wl,-soname,libmoe_routing.so.1")
        .arg(format!("-Wl,--version-script={}", exports.display()))
        .arg("-Wl,--no-undefined")
        .args(&inputs.objects)
        .arg(&inputs.cudart_static)
        .args(["-ldl", "-lrt", "-lpthread"]))?;
    install(&shared, &lib.join("libmoe_routing.so.1"))?;
    let link = lib.join("libmoe_routing.so");
    let tmp = temp_beside(&link);
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink("libmoe_routing.so.1", &tmp).map_err(io)?;
    std::fs::rename(&tmp, &link).map_err(io)?;

    // CMake package and pkg-config files, from their templates.
    let fill = |name: &str, dst: PathBuf| -> Result<()> {
        let template = root.join("cpp/package").join(name);
        let text = std::fs::read_to_string(&template)
            .map_err(|e| format!("{}: {e}", template.display()))?;
        let text = text
            .replace("@VERSION@", &inputs.version)
            .replace("@CUDA_INCLUDE@", &inputs.cuda_include);
        write(&dst, &text)
    };
    let cmake = lib.join("cmake/moe_routing");
    fill(
        "moe_routingConfig.cmake.in",
        cmake.join("moe_routingConfig.cmake"),
    )?;
    fill(
        "moe_routingConfigVersion.cmake.in",
        cmake.join("moe_routingConfigVersion.cmake"),
    )?;
    fill("moe_routing.pc.in", lib.join("pkgconfig/moe_routing.pc"))?;
    fill(
        "moe_routing-shared.pc.in",
        lib.join("pkgconfig/moe_routing-shared.pc"),
    )?;
    Ok(pkg)
}

/// Builds the library and returns its build script's inputs for the package.
fn build(root: &Path, release: bool) -> Result<Inputs> {
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(root)
        .args(["build", "--package", "moe-routing", "--lib"])
        .arg("--message-format=json-render-diagnostics")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if release {
        cmd.arg("--release");
    }
    let output = cmd.output().map_err(|e| format!("cargo build: {e}"))?;
    if !output.status.success() {
        return Err("cargo build failed".into());
    }
    // The library's build-script-executed message: its package id is the repository root's
    // ("path+file://<root>#0.1.0", or "...#moe-routing@0.1.0" where the folder has another
    // name), and its out_dir holds package.txt.
    let stdout = String::from_utf8_lossy(&output.stdout);
    let own = format!(r#""package_id":"path+file://{}#"#, root.display());
    let out = stdout
        .lines()
        .filter(|l| l.contains(r#""reason":"build-script-executed""#))
        .filter(|l| l.contains(&own) || l.contains("#moe-routing@"))
        .find_map(|l| json_string(l, "out_dir"))
        .ok_or("no build script output of moe-routing in cargo's messages")?;
    let out = PathBuf::from(out);
    let list = std::fs::read_to_string(out.join("package.txt"))
        .map_err(|e| format!("{}: {e}", out.join("package.txt").display()))?;
    let mut inputs = Inputs {
        out,
        version: String::new(),
        cuda_include: String::new(),
        cudart_static: PathBuf::new(),
        objects: Vec::new(),
    };
    for line in list.lines() {
        match line.split_once('=') {
            Some(("version", v)) => inputs.version = v.into(),
            Some(("cuda_include", v)) => inputs.cuda_include = v.into(),
            Some(("cudart_static", v)) => inputs.cudart_static = v.into(),
            Some(("object", v)) => inputs.objects.push(v.into()),
            _ => return Err(format!("package.txt: unexpected line {line:?}")),
        }
    }
    Ok(inputs)
}

/// The value of `"key":"value"` in one line of cargo's JSON (paths without escapes).
fn json_string(line: &str, key: &str) -> Option<String> {
    let start = line.find(&format!(r#""{key}":""#))? + key.len() + 4;
    let len = line[start..].find('"')?;
    let value = &line[start..start + len];
    (!value.contains('\\')).then(|| value.to_string())
}

fn io(e: std::io::Error) -> String {
    e.to_string()
}

fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd
        .status()
        .map_err(|e| format!("failed to run {cmd:?}: {e}"))?;
    status
        .success()
        .then_some(())
        .ok_or_else(|| format!("{cmd:?} failed"))
}

/// Replaces `dst` by a copy of `src` (through a rename, so readers never see half a file).
fn install(src: &Path, dst: &Path) -> Result<()> {
    let tmp = temp_beside(dst);
    std::fs::copy(src, &tmp).map_err(|e| format!("copy {}: {e}", src.display()))?;
    std::fs::rename(&tmp, dst).map_err(|e| format!("rename to {}: {e}", dst.display()))
}

/// Replaces `dst` by `text` (through a rename).
fn write(dst: &Path, text: &str) -> Result<()> {
    let tmp = temp_beside(dst);
    std::fs::write(&tmp, text).map_err(|e| format!("write {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, dst).map_err(|e| format!("rename to {}: {e}", dst.display()))
}

fn temp_beside(dst: &Path) -> PathBuf {
    let name = dst.file_name().unwrap().to_string_lossy();
    dst.with_file_name(format!(".{name}.{}", std::process::id()))
}
