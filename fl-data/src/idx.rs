//! The IDX format of MNIST and Fashion-MNIST (`*-idx3-ubyte` images, `*-idx1-ubyte` labels),
//! read raw or gzip-compressed (detected by the gzip magic, not the file name).

use std::io::Read;
use std::path::Path;

use crate::{DataError, Dataset};

const IMAGES_MAGIC: u32 = 0x0000_0803;
const LABELS_MAGIC: u32 = 0x0000_0801;

/// Reads a whole file, inflating it if it starts with the gzip magic.
pub(crate) fn read_maybe_gzip(path: &Path) -> Result<Vec<u8>, DataError> {
    let io = |source| DataError::Io {
        path: path.to_path_buf(),
        source,
    };
    let raw = std::fs::read(path).map_err(io)?;
    decompress_if_gzip(raw).map_err(|e| DataError::corrupt(path, format!("bad gzip data: {e}")))
}

fn decompress_if_gzip(raw: Vec<u8>) -> std::io::Result<Vec<u8>> {
    if raw.starts_with(&[0x1f, 0x8b]) {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(raw.as_slice()).read_to_end(&mut out)?;
        Ok(out)
    } else {
        Ok(raw)
    }
}

fn header(bytes: &[u8], words: usize, path: &Path) -> Result<Vec<u32>, DataError> {
    if bytes.len() < 4 * words {
        return Err(DataError::corrupt(
            path,
            format!("truncated IDX header ({} bytes)", bytes.len()),
        ));
    }
    Ok(bytes[..4 * words]
        .chunks_exact(4)
        .map(|w| u32::from_be_bytes([w[0], w[1], w[2], w[3]]))
        .collect())
}

/// Parses IDX image bytes: returns the pixels and `[rows, cols]`.
pub fn parse_images(bytes: &[u8], path: &Path) -> Result<(Vec<u8>, usize, [usize; 2]), DataError> {
    let h = header(bytes, 4, path)?;
    if h[0] != IMAGES_MAGIC {
        return Err(DataError::corrupt(
            path,
            format!(
                "wrong magic {:#010x} for IDX images (expected {IMAGES_MAGIC:#010x})",
                h[0]
            ),
        ));
    }
    let (n, rows, cols) = (h[1] as usize, h[2] as usize, h[3] as usize);
    let payload = &bytes[16..];
    // A damaged header can promise more bytes than a usize holds.
    let expected = n.checked_mul(rows).and_then(|v| v.checked_mul(cols));
    if expected != Some(payload.len()) {
        return Err(DataError::corrupt(
            path,
            format!(
                "header promises {n} images of {rows}x{cols} ({} bytes) but the payload has {} bytes",
                expected.map_or("more than addressable".to_string(), |e| e.to_string()),
                payload.len()
            ),
        ));
    }
    Ok((payload.to_vec(), n, [rows, cols]))
}

/// Parses IDX label bytes.
pub fn parse_labels(bytes: &[u8], path: &Path) -> Result<Vec<u16>, DataError> {
    let h = header(bytes, 2, path)?;
    if h[0] != LABELS_MAGIC {
        return Err(DataError::corrupt(
            path,
            format!(
                "wrong magic {:#010x} for IDX labels (expected {LABELS_MAGIC:#010x})",
                h[0]
            ),
        ));
    }
    let n = h[1] as usize;
    let payload = &bytes[8..];
    if payload.len() != n {
        return Err(DataError::corrupt(
            path,
            format!(
                "header promises {n} labels but the payload has {} bytes",
                payload.len()
            ),
        ));
    }
    Ok(payload.iter().map(|&b| b as u16).collect())
}

/// Builds a 1-channel dataset from parsed IDX images and labels, checking that they agree.
pub fn dataset_from_bytes(
    images: &[u8],
    labels: &[u8],
    images_path: &Path,
    labels_path: &Path,
    num_classes: usize,
) -> Result<Dataset, DataError> {
    let (pixels, n, [rows, cols]) = parse_images(images, images_path)?;
    let labels = parse_labels(labels, labels_path)?;
    if labels.len() != n {
        return Err(DataError::corrupt(
            labels_path,
            format!(
                "{} labels for {n} images in {}",
                labels.len(),
                images_path.display()
            ),
        ));
    }
    if let Some(bad) = labels.iter().find(|&&l| l as usize >= num_classes) {
        return Err(DataError::corrupt(
            labels_path,
            format!("label {bad} out of range for {num_classes} classes"),
        ));
    }
    Dataset::new(pixels, labels, [1, rows, cols], num_classes)
}

/// Reads an image file and a label file (each raw or gzip) into a dataset.
pub fn read_pair(images: &Path, labels: &Path, num_classes: usize) -> Result<Dataset, DataError> {
    let image_bytes = read_maybe_gzip(images)?;
    let label_bytes = read_maybe_gzip(labels)?;
    dataset_from_bytes(&image_bytes, &label_bytes, images, labels, num_classes)
}

/// Inflates in-memory bytes that may be gzip (used for the embedded copy).
pub(crate) fn inflate(bytes: &[u8]) -> Vec<u8> {
    decompress_if_gzip(bytes.to_vec()).expect("embedded gzip data is valid")
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::io::Write;

    /// Encodes images and labels in the IDX format, as the fixtures of other tests need.
    pub fn encode(
        images: &[u8],
        n: usize,
        rows: usize,
        cols: usize,
        labels: &[u8],
    ) -> (Vec<u8>, Vec<u8>) {
        let mut img = Vec::new();
        for w in [IMAGES_MAGIC, n as u32, rows as u32, cols as u32] {
            img.extend_from_slice(&w.to_be_bytes());
        }
        img.extend_from_slice(images);
        let mut lab = Vec::new();
        for w in [LABELS_MAGIC, labels.len() as u32] {
            lab.extend_from_slice(&w.to_be_bytes());
        }
        lab.extend_from_slice(labels);
        (img, lab)
    }

    fn gzip(bytes: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        e.write_all(bytes).unwrap();
        e.finish().unwrap()
    }

    fn write(dir: &Path, name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    #[test]
    fn reads_raw_and_gzip_fixtures_identically() {
        let dir = tempfile::tempdir().unwrap();
        let pixels: Vec<u8> = (0..3 * 4 * 5).map(|i| i as u8).collect();
        let (img, lab) = encode(&pixels, 3, 4, 5, &[0, 9, 3]);
        let raw = read_pair(
            &write(dir.path(), "i", &img),
            &write(dir.path(), "l", &lab),
            10,
        )
        .unwrap();
        let gz = read_pair(
            &write(dir.path(), "i.gz", &gzip(&img)),
            &write(dir.path(), "l.gz", &gzip(&lab)),
            10,
        )
        .unwrap();
        assert_eq!(raw.len(), 3);
        assert_eq!(raw.image_shape(), [1, 4, 5]);
        assert_eq!(raw.labels(), &[0, 9, 3]);
        assert_eq!(raw.image(1), &pixels[20..40]);
        assert_eq!(gz.labels(), raw.labels());
        assert_eq!(gz.image(2), raw.image(2));
    }

    #[test]
    fn corrupt_files_give_errors_naming_the_problem() {
        let dir = tempfile::tempdir().unwrap();
        let (img, lab) = encode(&[0; 2 * 4], 2, 2, 2, &[1, 2]);
        let p = |n: &str, b: &[u8]| write(dir.path(), n, b);
        let msg = |r: Result<Dataset, DataError>| r.unwrap_err().to_string();

        // wrong magic: a labels header on an images file
        let mut bad = img.clone();
        bad[3] = 0x01;
        let e = msg(read_pair(&p("a", &bad), &p("b", &lab), 10));
        assert!(e.contains("wrong magic"), "{e}");
        // truncated payload
        let e = msg(read_pair(&p("c", &img[..img.len() - 1]), &p("d", &lab), 10));
        assert!(e.contains("payload has 7 bytes"), "{e}");
        // a header whose sizes multiply past usize (found by the fuzz test)
        let mut huge = img.clone();
        huge[4..16].copy_from_slice(&[0xff; 12]);
        let e = msg(read_pair(&p("c2", &huge), &p("d2", &lab), 10));
        assert!(e.contains("more than addressable"), "{e}");
        // truncated header
        let e = msg(read_pair(&p("e", &img[..6]), &p("f", &lab), 10));
        assert!(e.contains("truncated IDX header"), "{e}");
        // count mismatch
        let (_, lab3) = encode(&[], 0, 0, 0, &[1, 2, 3]);
        let e = msg(read_pair(&p("g", &img), &p("h", &lab3), 10));
        assert!(e.contains("3 labels for 2 images"), "{e}");
        // label out of range
        let e = msg(read_pair(&p("i", &img), &p("j", &lab), 2));
        assert!(e.contains("label 2 out of range"), "{e}");
        // bad gzip
        let e = msg(read_pair(
            &p("k", &[0x1f, 0x8b, 1, 2, 3]),
            &p("l", &lab),
            10,
        ));
        assert!(e.contains("bad gzip"), "{e}");
        // missing file names the path
        let e = msg(read_pair(&dir.path().join("nope"), &p("m", &lab), 10));
        assert!(e.contains("nope"), "{e}");
    }
}
