//! Pinned outputs: for a fixed seed, every algorithm's `metrics.jsonl` (without wall-clock
//! fields) and final weights must stay bit for bit what `tests/pinned.json` records. Refactors
//! change no results; a change that is meant to change results updates the pins on purpose:
//!
//! ```text
//! FL_UPDATE_PINS=1 cargo test -p fl-cli --test pinned
//! ```
//!
//! Floating-point results may depend on the CPU's vector instructions (the kernels pick AVX-512,
//! AVX2 or scalar code at run time), so pins are kept per instruction tier. Today every pinned
//! run gives the same bits on AVX2 as on AVX-512 (the direct convolutions compute the same
//! chains of sums on both), and a test keeps the two tiers' pins equal.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::{DEBIAN_FMNIST, FL, metrics, weights, words};
use sha2::{Digest, Sha256};

const PINS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/pinned.json");

/// Shared settings: real Fashion-MNIST, 3 of 200 clients (about 900 images a round), 2 rounds.
const BASE: &str = "--clients 200 --sample 3 --rounds 2 --local-epochs 1 --batch-size 32 \
    --partition dirichlet --alpha 0.5 --seed 11 --threads 2 --quiet";

/// pFedClub's settings: 5 clients of zoo III on 1,000 pooled samples.
const CLUB: &str = "--clients 5 --sample 2 --rounds 2 --local-epochs 1 --max-samples 1000 \
    --cka-samples 32 --candidates 2 --public-samples 48 --seed 5 --threads 2 --quiet";

/// (name, arguments) of every pinned run.
fn cases() -> Vec<(&'static str, Vec<&'static str>)> {
    let global = |alg: &'static str, extra: &[&'static str]| {
        let mut a = vec![alg];
        a.extend(words(BASE));
        a.extend_from_slice(extra);
        a
    };
    let club = |extra: &[&'static str]| {
        let mut a = vec!["pfedclub"];
        a.extend(words(CLUB));
        a.extend_from_slice(extra);
        a
    };
    vec![
        ("fedavg", global("fedavg", &[])),
        ("fedavg-unweighted", global("fedavg", &["--unweighted"])),
        ("fedmr", global("fedmr", &[])),
        (
            "fedmr-two-stage-layer",
            global("fedmr", &["--first-stage", "1", "--granularity", "layer"]),
        ),
        ("fedcross", global("fedcross", &[])),
        (
            "fedcross-first-stage",
            global("fedcross", &["--first-stage", "1"]),
        ),
        ("fedindep", global("fedindep", &[])),
        ("fedprox", global("fedprox", &["--mu", "0.1"])),
        ("scaffold", global("scaffold", &[])),
        ("fedavgm", global("fedavgm", &[])),
        ("fedexp", global("fedexp", &[])),
        ("fedmut", global("fedmut", &["--mut-bound", "2"])),
        ("moon", global("moon", &[])),
        ("fedasam", global("fedasam", &[])),
        ("clusamp", global("clusamp", &[])),
        ("fedgen", global("fedgen", &[])),
        ("pfedclub", club(&[])),
        ("pfedclub-no-rules", club(&["--variant", "club-no-rules"])),
        ("pfedclub-pfedhr", club(&["--variant", "pfedhr"])),
        ("pfedclub-fedavg", club(&["--variant", "fedavg"])),
    ]
}

fn sha(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// SHA-256 of metrics.jsonl without its wall-clock fields, keys sorted (the digest does not
/// depend on the writer's field order).
fn metrics_digest(dir: &Path) -> String {
    let mut canonical = String::new();
    for line in metrics(dir) {
        let sorted: BTreeMap<_, _> = line.as_object().unwrap().iter().collect();
        canonical.push_str(&serde_json::to_string(&sorted).unwrap());
        canonical.push('\n');
    }
    sha(canonical.as_bytes())
}

/// SHA-256 of the final weights: every tensor of the last checkpoint (the server's models and
/// state, or every client's model), by name.
fn weights_digest(dir: &Path) -> String {
    let tensors = weights(dir);
    assert!(!tensors.is_empty(), "no tensors in the checkpoint");
    let mut h = Sha256::new();
    for (name, data) in tensors {
        h.update(name.as_bytes());
        h.update(&data);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

fn tier() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx512f") {
            return "x86_64-avx512";
        }
        if std::is_x86_feature_detected!("avx2") {
            return "x86_64-avx2";
        }
    }
    "other"
}

type Pins = BTreeMap<String, BTreeMap<String, [String; 2]>>;

#[test]
fn every_algorithm_reproduces_its_pinned_outputs() {
    // Without the Debian package `fl` trains on its embedded subset of Fashion-MNIST, and every
    // pin would read as changed.
    assert!(
        Path::new(DEBIAN_FMNIST)
            .join("train-images-idx3-ubyte.gz")
            .is_file(),
        "the pins are of runs on Debian's Fashion-MNIST, and {DEBIAN_FMNIST} is missing: \
         apt-get install dataset-fashion-mnist"
    );
    let dir = tempfile::tempdir().unwrap();
    let mut got = BTreeMap::new();
    for (name, args) in cases() {
        let out = dir.path().join(name);
        let o = std::process::Command::new(FL)
            .args(&args)
            .arg("--out")
            .arg(&out)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "fl {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        got.insert(
            name.to_string(),
            [metrics_digest(&out), weights_digest(&out)],
        );
    }
    let mut pins: Pins = std::fs::read_to_string(PINS)
        .ok()
        .map(|t| serde_json::from_str(&t).expect("valid pins file"))
        .unwrap_or_default();
    if std::env::var_os("FL_UPDATE_PINS").is_some() {
        pins.insert(tier().to_string(), got);
        std::fs::write(PINS, serde_json::to_string_pretty(&pins).unwrap() + "\n").unwrap();
        return;
    }
    let Some(expected) = pins.get(tier()) else {
        panic!(
            "no pinned outputs for this CPU ({}); record them from a known-good commit with FL_UPDATE_PINS=1",
            tier()
        );
    };
    let mut wrong = Vec::new();
    for (name, digests) in &got {
        match expected.get(name) {
            Some(e) if e == digests => {}
            Some(e) => wrong.push(format!(
                "{name}: metrics {} weights {}",
                if e[0] == digests[0] {
                    "same"
                } else {
                    "CHANGED"
                },
                if e[1] == digests[1] {
                    "same"
                } else {
                    "CHANGED"
                }
            )),
            None => wrong.push(format!("{name}: not pinned")),
        }
    }
    assert!(
        wrong.is_empty(),
        "outputs differ from the pins:\n{}",
        wrong.join("\n")
    );
}

/// Every pinned run gives the same bits on AVX2 CPUs as on AVX-512 ones: pins recorded on
/// either tier must agree. (A change that gives up this agreement on purpose says so here.)
#[test]
fn avx2_and_avx512_pins_agree() {
    let pins: Pins = serde_json::from_str(&std::fs::read_to_string(PINS).unwrap()).unwrap();
    let (Some(avx2), Some(avx512)) = (pins.get("x86_64-avx2"), pins.get("x86_64-avx512")) else {
        panic!("pins for both x86-64 tiers are expected");
    };
    let differ: Vec<&String> = avx2
        .keys()
        .chain(avx512.keys())
        .filter(|name| avx2.get(*name) != avx512.get(*name))
        .collect();
    assert!(
        differ.is_empty(),
        "AVX2 and AVX-512 pins differ for {differ:?}"
    );
}
