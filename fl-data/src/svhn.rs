//! SVHN cropped digits (`train_32x32.mat`, `test_32x32.mat`, MATLAB v5), read with the
//! `matfile` crate: `X` is a 32×32×3×N `uint8` array (column-major), `y` holds the labels
//! 1–10 with 10 standing for the digit 0.

use std::path::{Path, PathBuf};

use crate::{DataError, Dataset};

/// The files of the cropped-digits distribution.
pub const FILES: [&str; 2] = ["train_32x32.mat", "test_32x32.mat"];

/// The directory under `dir` (itself or `svhn/`) holding both files.
pub fn locate(dir: &Path) -> Option<PathBuf> {
    [dir.to_path_buf(), dir.join("svhn")]
        .into_iter()
        .find(|d| FILES.iter().all(|f| d.join(f).is_file()))
}

/// Reads the training and test sets from `dir` (as returned by [`locate`]).
pub fn read_svhn(dir: &Path) -> Result<(Dataset, Dataset), DataError> {
    Ok((
        read_mat(&dir.join(FILES[0]))?,
        read_mat(&dir.join(FILES[1]))?,
    ))
}

/// Reads one SVHN `.mat` file.
pub fn read_mat(path: &Path) -> Result<Dataset, DataError> {
    let bad = |problem: String| DataError::corrupt(path, problem);
    let file = std::fs::File::open(path).map_err(|source| DataError::Io {
        path: path.into(),
        source,
    })?;
    let mat = matfile::MatFile::parse(std::io::BufReader::new(file))
        .map_err(|e| bad(format!("not a MATLAB v5 file: {e:?}")))?;
    let x = mat
        .find_by_name("X")
        .ok_or_else(|| bad("no array 'X' (the images)".into()))?;
    let y = mat
        .find_by_name("y")
        .ok_or_else(|| bad("no array 'y' (the labels)".into()))?;
    let size = x.size();
    if size.len() != 4 || size[..3] != [32, 32, 3] {
        return Err(bad(format!(
            "X has shape {size:?}, expected [32, 32, 3, N]"
        )));
    }
    let n = size[3];
    let matfile::NumericData::UInt8 { real: pixels, .. } = x.data() else {
        return Err(bad("X is not a uint8 array".into()));
    };
    if n.checked_mul(32 * 32 * 3) != Some(pixels.len()) {
        return Err(bad(format!(
            "X holds {} values for {n} images",
            pixels.len()
        )));
    }
    let raw_labels: Vec<f64> = match y.data() {
        matfile::NumericData::Double { real, .. } => real.clone(),
        matfile::NumericData::UInt8 { real, .. } => real.iter().map(|&v| f64::from(v)).collect(),
        _ => return Err(bad("y is neither double nor uint8".into())),
    };
    if raw_labels.len() != n {
        return Err(bad(format!("{n} images but {} labels", raw_labels.len())));
    }
    let mut labels = Vec::with_capacity(n);
    for (i, &v) in raw_labels.iter().enumerate() {
        if v.fract() != 0.0 || !(1.0..=10.0).contains(&v) {
            return Err(bad(format!("label {i} is {v}, expected 1..10")));
        }
        labels.push((v as u16) % 10);
    }
    // Column-major X(row, col, channel, n) → our N×C×H×W.
    let mut images = vec![0u8; pixels.len()];
    for img in 0..n {
        for c in 0..3 {
            for row in 0..32 {
                for col in 0..32 {
                    images[((img * 3 + c) * 32 + row) * 32 + col] =
                        pixels[((img * 3 + c) * 32 + col) * 32 + row];
                }
            }
        }
    }
    Dataset::new(images, labels, [3, 32, 32], 10).map_err(|e| bad(e.to_string()))
}

/// Writes a MATLAB v5 file holding SVHN-style `X` (`images[n]` as C×H×W bytes) and `y` (the
/// labels as doubles), optionally with zlib-compressed elements as MATLAB writes them: the
/// fixtures of the tests.
#[doc(hidden)]
pub fn write_fixture(
    path: &Path,
    images: &[Vec<u8>],
    labels: &[f64],
    compressed: bool,
) -> std::io::Result<()> {
    use std::io::Write;
    fn element(kind: u32, data: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend(kind.to_le_bytes());
        out.extend((data.len() as u32).to_le_bytes());
        out.extend(data);
        out.resize(out.len().div_ceil(8) * 8, 0);
        out
    }
    fn matrix(name: &str, class: u32, dims: &[usize], data_kind: u32, data: &[u8]) -> Vec<u8> {
        let mut body = element(6, &[class.to_le_bytes(), 0u32.to_le_bytes()].concat());
        let dims: Vec<u8> = dims
            .iter()
            .flat_map(|&d| (d as i32).to_le_bytes())
            .collect();
        body.extend(element(5, &dims));
        body.extend(element(1, name.as_bytes()));
        body.extend(element(data_kind, data));
        element(14, &body)
    }
    let n = images.len();
    let mut x = vec![0u8; 3072 * n];
    for (img, pixels) in images.iter().enumerate() {
        for c in 0..3 {
            for row in 0..32 {
                for col in 0..32 {
                    x[((img * 3 + c) * 32 + col) * 32 + row] = pixels[(c * 32 + row) * 32 + col];
                }
            }
        }
    }
    let y: Vec<u8> = labels.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut header = b"MATLAB 5.0 MAT-file, written by fl-data tests".to_vec();
    header.resize(116, b' ');
    header.extend([0u8; 8]);
    header.extend(0x0100u16.to_le_bytes());
    header.extend(b"IM");
    let mut file = header;
    for m in [
        matrix("X", 9, &[32, 32, 3, n], 2, &x),
        matrix("y", 6, &[labels.len(), 1], 9, &y),
    ] {
        if compressed {
            let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::fast());
            z.write_all(&m)?;
            let packed = z.finish()?;
            // Compressed elements are not padded.
            file.extend(15u32.to_le_bytes());
            file.extend((packed.len() as u32).to_le_bytes());
            file.extend(packed);
        } else {
            file.extend(m);
        }
    }
    std::fs::write(path, file)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(seed: u8) -> Vec<u8> {
        (0..3072)
            .map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn reads_plain_and_compressed_files_with_label_ten_as_zero() {
        let dir = tempfile::tempdir().unwrap();
        for compressed in [false, true] {
            let path = dir.path().join(format!("train_{compressed}.mat"));
            let images: Vec<Vec<u8>> = (0..5).map(image).collect();
            write_fixture(&path, &images, &[1.0, 10.0, 3.0, 10.0, 9.0], compressed).unwrap();
            let d = read_mat(&path).unwrap();
            assert_eq!(d.len(), 5);
            assert_eq!(d.image_shape(), [3, 32, 32]);
            assert_eq!(d.labels(), &[1, 0, 3, 0, 9]);
            for (i, img) in images.iter().enumerate() {
                assert_eq!(d.image(i), &img[..], "image {i} (compressed: {compressed})");
            }
        }
    }

    #[test]
    fn bad_files_are_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.mat");
        std::fs::write(&path, b"not a mat file").unwrap();
        let err = read_mat(&path).unwrap_err().to_string();
        assert!(err.contains("bad.mat") && err.contains("MATLAB"), "{err}");
        write_fixture(&path, &[image(0), image(1)], &[1.0], false).unwrap();
        let err = read_mat(&path).unwrap_err().to_string();
        assert!(err.contains("2 images but 1 labels"), "{err}");
        write_fixture(&path, &[image(0)], &[11.0], false).unwrap();
        let err = read_mat(&path).unwrap_err().to_string();
        assert!(err.contains("expected 1..10"), "{err}");
        // Truncated.
        write_fixture(&path, &[image(0), image(1)], &[1.0, 2.0], false).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
        assert!(read_mat(&path).is_err());
    }
}
