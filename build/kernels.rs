//! The translation units: every `.cu` of `cpp/src`, then one per fused kernel of
//! `cpp/src/fused_kernels.def` (CMakeLists.txt reads the table the same way).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// One nvcc translation unit: its source, its object's name, a define.
pub struct Unit {
    pub src: PathBuf,
    pub name: String,
    pub define: Option<String>,
}

pub fn units(manifest: &Path) -> Vec<Unit> {
    let mut units: Vec<Unit> = std::fs::read_dir(manifest.join("cpp/src"))
        .expect("cpp/src")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .map(|src| Unit {
            name: src.file_stem().unwrap().to_string_lossy().into_owned(),
            src,
            define: None,
        })
        .collect();
    units.sort_by(|a, b| a.name.cmp(&b.name));
    units.extend(fused_kernels(manifest));
    units
}

/// `cpp/src/instances/<kind>.cu` once per row of the table (`FUSED_FORWARD(...)`,
/// `FUSED_BACKWARD(...)`, one per line), with `-DMOE_ROUTING_ROW=<the row's index among its
/// kind>`; objects named after the row (`fused_backward_160_8_128`).
fn fused_kernels(manifest: &Path) -> Vec<Unit> {
    let table = manifest.join("cpp/src/fused_kernels.def");
    let text = std::fs::read_to_string(&table).expect("cpp/src/fused_kernels.def");
    let mut rows = HashMap::<String, usize>::new();
    let mut units = Vec::new();
    for line in text.lines().map(str::trim) {
        let Some((kind, args)) = line
            .strip_prefix("FUSED_")
            .and_then(|l| l.strip_suffix(')'))
            .and_then(|l| l.split_once('('))
        else {
            continue;
        };
        let kind = format!("fused_{}", kind.to_ascii_lowercase());
        let src = manifest.join(format!("cpp/src/instances/{kind}.cu"));
        assert!(src.exists(), "{}: no {}", table.display(), src.display());
        let row = rows.entry(kind.clone()).or_default();
        let args: Vec<&str> = args.split(',').map(str::trim).collect();
        units.push(Unit {
            src,
            name: format!("{kind}_{}", args.join("_")),
            define: Some(format!("-DMOE_ROUTING_ROW={row}")),
        });
        *row += 1;
    }
    assert!(!units.is_empty(), "no rows in {}", table.display());
    units
}
