//! nvcc over the translation units, in parallel, each recompiled only when its command or one
//! of the files it read changed; then one archive of the objects.
//!
//! (Not the `cc` crate's CUDA mode: it recompiles every unit whenever the build script reruns,
//! which for these kernels is minutes of nvcc after any change, and it cannot bound the number
//! of nvcc processes by memory.)

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::kernels::Unit;

/// The flags of every unit: `cpp/nvcc.flags` (one per line, # comments; shared with
/// CMakeLists.txt), then `MOE_ROUTING_NVCC_FLAGS` (whitespace separated).
pub struct Flags {
    file: Vec<String>,
    extra: Vec<String>,
}

impl Flags {
    pub fn read(manifest: &Path) -> Flags {
        let file = std::fs::read_to_string(manifest.join("cpp/nvcc.flags"))
            .expect("cpp/nvcc.flags")
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(String::from)
            .collect();
        let extra = env::var("MOE_ROUTING_NVCC_FLAGS")
            .map(|s| s.split_whitespace().map(String::from).collect())
            .unwrap_or_default();
        Flags { file, extra }
    }

    pub fn all(&self) -> Vec<String> {
        [self.file.clone(), self.extra.clone()].concat()
    }
}

pub struct Job<'a> {
    pub nvcc: &'a Path,
    pub flags: &'a Flags,
    pub includes: &'a [PathBuf],
    pub units: &'a [Unit],
    pub out: &'a Path,
}

/// Compiles every unit into `out/<name>.o` and returns the objects, in the units' order. At most
/// `MOE_ROUTING_NVCC_JOBS` (else cargo's job count, else 2) nvcc at once: one nvcc of a fused
/// kernel takes a few GB, and all of them at once exhaust a small machine's memory.
pub fn compile(job: &Job) -> Vec<PathBuf> {
    let jobs = env::var("MOE_ROUTING_NVCC_JOBS")
        .or_else(|_| env::var("NUM_JOBS"))
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(2);
    let commands: Vec<(PathBuf, Mutex<Command>)> = job
        .units
        .iter()
        .map(|unit| {
            let obj = job.out.join(&unit.name).with_extension("o");
            let mut cmd = Command::new(job.nvcc);
            cmd.args(&job.flags.file).args(&unit.define).arg("-c");
            for dir in job.includes {
                cmd.arg("-I").arg(dir);
            }
            cmd.args(&job.flags.extra)
                .arg(&unit.src)
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
                assert!(status.success(), "nvcc failed on {}", job.units[i].name);
                // The command beside the object: another command (flags, toolchain) rebuilds.
                std::fs::write(obj.with_extension("cmd"), format!("{cmd:?}")).expect("write .cmd");
            });
        }
    });
    commands.into_iter().map(|(obj, _)| obj).collect()
}

/// Replaces `lib` by an archive of `objects`.
pub fn archive(lib: &Path, objects: &[PathBuf]) {
    let _ = std::fs::remove_file(lib);
    let status = Command::new("ar")
        .arg("crs")
        .arg(lib)
        .args(objects)
        .status()
        .expect("failed to run ar");
    assert!(status.success(), "ar failed");
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
