//! FEMNIST in LEAF's JSON format: `train/*.json` and `test/*.json`, each file
//! `{"users": [...], "user_data": {uid: {"x": [[784 floats in 0..1]], "y": [labels]}}}`.
//!
//! Every writer is one client (the natural partition); 62 classes (digits, upper, lower case).
//! Files are read in name order and writers in each file's `users` order, so client i is the
//! same writer on every machine. Pixels are stored as `u8` (`round(255·x)`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::{DataError, Dataset};

/// FEMNIST's classes.
pub const CLASSES: usize = 62;
const PIXELS: usize = 28 * 28;

#[derive(serde::Deserialize)]
struct LeafFile {
    users: Vec<String>,
    user_data: HashMap<String, UserData>,
}

#[derive(serde::Deserialize)]
struct UserData {
    x: Vec<Vec<f32>>,
    y: Vec<i64>,
}

/// The directory holding `train/` and `test/`: `dir` itself or `dir/data` (LEAF's layout).
pub fn locate(dir: &Path) -> Option<PathBuf> {
    [dir.to_path_buf(), dir.join("data")].into_iter().find(|d| {
        !json_files(&d.join("train")).is_empty() && !json_files(&d.join("test")).is_empty()
    })
}

fn json_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "json"))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

/// One split: the samples and, per writer, the indices of its samples.
fn read_split(dir: &Path) -> Result<(Dataset, Vec<Vec<usize>>), DataError> {
    let (mut images, mut labels, mut writers) = (Vec::new(), Vec::new(), Vec::new());
    for path in json_files(dir) {
        let text = std::fs::read(&path).map_err(|source| DataError::Io {
            path: path.clone(),
            source,
        })?;
        let file: LeafFile = serde_json::from_slice(&text)
            .map_err(|e| DataError::corrupt(&path, format!("not LEAF JSON: {e}")))?;
        for user in &file.users {
            let data = file.user_data.get(user).ok_or_else(|| {
                DataError::corrupt(
                    &path,
                    format!("user '{user}' is listed but has no user_data"),
                )
            })?;
            if data.x.len() != data.y.len() {
                return Err(DataError::corrupt(
                    &path,
                    format!(
                        "user '{user}': {} images but {} labels",
                        data.x.len(),
                        data.y.len()
                    ),
                ));
            }
            let start = labels.len();
            for (i, (x, &y)) in data.x.iter().zip(&data.y).enumerate() {
                if x.len() != PIXELS {
                    return Err(DataError::corrupt(
                        &path,
                        format!("user '{user}' image {i}: {} values, expected 784", x.len()),
                    ));
                }
                if !(0..CLASSES as i64).contains(&y) {
                    return Err(DataError::corrupt(
                        &path,
                        format!("user '{user}' image {i}: label {y} out of range for 62 classes"),
                    ));
                }
                if let Some(v) = x.iter().find(|v| !(0.0..=1.0).contains(*v)) {
                    return Err(DataError::corrupt(
                        &path,
                        format!("user '{user}' image {i}: pixel {v} outside [0, 1]"),
                    ));
                }
                images.extend(x.iter().map(|v| (v * 255.0).round() as u8));
                labels.push(y as u16);
            }
            writers.push((start..labels.len()).collect());
        }
    }
    if labels.is_empty() {
        return Err(DataError::corrupt(dir, "no samples in the LEAF JSON files"));
    }
    Ok((Dataset::new(images, labels, [1, 28, 28], CLASSES)?, writers))
}

/// Reads FEMNIST from a directory found by [`locate`]: training set, test set and the training
/// indices of each writer (the natural partition).
pub fn read_femnist(dir: &Path) -> Result<(Dataset, Dataset, Vec<Vec<usize>>), DataError> {
    let (train, writers) = read_split(&dir.join("train"))?;
    let (test, _) = read_split(&dir.join("test"))?;
    Ok((train, test, writers))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Writes a LEAF-format FEMNIST fixture: `writers` writers per split file, two files per
    /// split, `per_writer` samples each, label = (writer + sample) mod 62.
    pub fn write_fixture(root: &Path, writers: usize, per_writer: usize) {
        for split in ["train", "test"] {
            let dir = root.join(split);
            std::fs::create_dir_all(&dir).unwrap();
            for file in 0..2 {
                let users: Vec<String> = (0..writers).map(|w| format!("f{file}_w{w:03}")).collect();
                let user_data: serde_json::Map<String, serde_json::Value> = users
                    .iter()
                    .enumerate()
                    .map(|(w, u)| {
                        let x: Vec<Vec<f32>> = (0..per_writer)
                            .map(|s| vec![((w + s) % 5) as f32 / 4.0; PIXELS])
                            .collect();
                        let y: Vec<usize> =
                            (0..per_writer).map(|s| (w + s + file) % CLASSES).collect();
                        (u.clone(), serde_json::json!({ "x": x, "y": y }))
                    })
                    .collect();
                let json = serde_json::json!({
                    "users": users,
                    "num_samples": vec![per_writer; writers],
                    "user_data": user_data,
                });
                std::fs::write(dir.join(format!("part_{file}.json")), json.to_string()).unwrap();
            }
        }
    }

    #[test]
    fn writers_become_clients_in_file_and_user_order() {
        let root = tempfile::tempdir().unwrap();
        write_fixture(&root.path().join("data"), 3, 4);
        let dir = locate(root.path()).unwrap();
        let (train, test, writers) = read_femnist(&dir).unwrap();
        assert_eq!(train.len(), 24);
        assert_eq!(test.len(), 24);
        assert_eq!(writers.len(), 6);
        assert_eq!(writers[1], vec![4, 5, 6, 7]);
        // Writer 0 of the second file: labels (0 + s + 1) mod 62.
        let labels: Vec<u16> = writers[3].iter().map(|&i| train.labels()[i]).collect();
        assert_eq!(labels, vec![1, 2, 3, 4]);
        assert_eq!(train.image(1)[0], 64); // 1/4 of 255, rounded
        assert_eq!(train.num_classes(), 62);
    }

    #[test]
    fn malformed_files_are_errors_naming_the_file() {
        let root = tempfile::tempdir().unwrap();
        write_fixture(root.path(), 1, 2);
        let bad = root.path().join("train/part_1.json");
        let cases = [
            (
                r#"{"users": ["a"], "user_data": {}}"#,
                "listed but has no user_data",
            ),
            (
                r#"{"users": ["a"], "user_data": {"a": {"x": [[0.5]], "y": [1]}}}"#,
                "1 values, expected 784",
            ),
            ("{not json", "not LEAF JSON"),
        ];
        for (text, expected) in cases {
            std::fs::write(&bad, text).unwrap();
            let e = read_femnist(root.path()).unwrap_err().to_string();
            assert!(e.contains("part_1.json") && e.contains(expected), "{e}");
        }
        let x = vec![vec![0.5f32; PIXELS]];
        let json = serde_json::json!({"users": ["a"], "user_data": {"a": {"x": x, "y": [62]}}});
        std::fs::write(&bad, json.to_string()).unwrap();
        let e = read_femnist(root.path()).unwrap_err().to_string();
        assert!(e.contains("label 62 out of range"), "{e}");
    }
}
