//! Users' own images: `ROOT/train/<class>/*.png|jpg|jpeg` and `ROOT/test/<class>/*`.
//!
//! Classes are the training subfolders in sorted order (test folders must use the same names);
//! files are read in sorted order within a class. All images must have one size; they are stored
//! as 1 channel if every image is greyscale, otherwise as RGB.

use std::path::{Path, PathBuf};

use image::DynamicImage;

use crate::{DataError, Dataset};

const EXTENSIONS: [&str; 3] = ["png", "jpg", "jpeg"];

/// Whether `dir` has `train/` and `test/` class folders.
pub fn locate(dir: &Path) -> Option<PathBuf> {
    let has_classes = |d: &Path| !class_dirs(d).is_empty();
    (has_classes(&dir.join("train")) && has_classes(&dir.join("test"))).then(|| dir.to_path_buf())
}

fn sorted_entries(dir: &Path, want_dirs: bool) -> Vec<PathBuf> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_dir() == want_dirs)
                .collect()
        })
        .unwrap_or_default();
    paths.sort();
    paths
}

fn class_dirs(dir: &Path) -> Vec<PathBuf> {
    sorted_entries(dir, true)
}

fn is_image(p: &Path) -> bool {
    p.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()))
}

/// Decoded images of one split with their class indices.
fn read_split(
    dir: &Path,
    classes: &[String],
) -> Result<Vec<(PathBuf, DynamicImage, u16)>, DataError> {
    let mut out = Vec::new();
    for class_dir in class_dirs(dir) {
        let name = class_dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let Some(label) = classes.iter().position(|c| *c == name) else {
            return Err(DataError::corrupt(
                &class_dir,
                format!("class '{name}' does not exist in the training set"),
            ));
        };
        for file in sorted_entries(&class_dir, false)
            .into_iter()
            .filter(|p| is_image(p))
        {
            let img = image::open(&file)
                .map_err(|e| DataError::corrupt(&file, format!("cannot decode image: {e}")))?;
            out.push((file, img, label as u16));
        }
    }
    if out.is_empty() {
        return Err(DataError::corrupt(
            dir,
            "no .png/.jpg images in the class folders",
        ));
    }
    Ok(out)
}

/// Reads `ROOT/train` and `ROOT/test`; returns both sets and the class names.
pub fn read_image_folder(root: &Path) -> Result<(Dataset, Dataset, Vec<String>), DataError> {
    let classes: Vec<String> = class_dirs(&root.join("train"))
        .iter()
        .filter_map(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    if classes.is_empty() {
        return Err(DataError::corrupt(
            root.join("train"),
            "no class folders (expected train/<class>/*.png)",
        ));
    }
    let train = read_split(&root.join("train"), &classes)?;
    let test = read_split(&root.join("test"), &classes)?;
    let all = || train.iter().chain(&test);
    let (w, h) = (train[0].1.width(), train[0].1.height());
    if let Some((path, img, _)) = all().find(|(_, i, _)| (i.width(), i.height()) != (w, h)) {
        return Err(DataError::corrupt(
            path,
            format!(
                "image is {}x{}, but {} is {w}x{h}; all images must have one size",
                img.width(),
                img.height(),
                train[0].0.display()
            ),
        ));
    }
    let grey = all().all(|(_, i, _)| i.color().channel_count() <= 2);
    let channels = if grey { 1 } else { 3 };
    let to_dataset = |items: &[(PathBuf, DynamicImage, u16)]| {
        let mut pixels = Vec::with_capacity(items.len() * channels * (w * h) as usize);
        let mut labels = Vec::with_capacity(items.len());
        for (_, img, label) in items {
            if grey {
                pixels.extend_from_slice(img.to_luma8().as_raw());
            } else {
                // Interleaved RGB to planar C×H×W.
                let rgb = img.to_rgb8();
                for c in 0..3 {
                    pixels.extend(rgb.pixels().map(|p| p.0[c]));
                }
            }
            labels.push(*label);
        }
        Dataset::new(
            pixels,
            labels,
            [channels, h as usize, w as usize],
            classes.len(),
        )
    };
    Ok((to_dataset(&train)?, to_dataset(&test)?, classes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn save(path: &Path, img: DynamicImage) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        img.save(path).unwrap();
    }

    #[test]
    fn classes_and_files_in_sorted_order_rgb_planar() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        for (split, class, file, value) in [
            ("train", "cat", "b.png", 30u8),
            ("train", "cat", "a.png", 20),
            ("train", "ant", "x.png", 10),
            ("test", "cat", "t.png", 40),
        ] {
            let img =
                image::RgbImage::from_fn(4, 3, |_, _| image::Rgb([value, value + 1, value + 2]));
            save(
                &r.join(split).join(class).join(file),
                DynamicImage::ImageRgb8(img),
            );
        }
        std::fs::write(r.join("train/cat/notes.txt"), "ignored").unwrap();
        let (train, test, classes) = read_image_folder(&locate(r).unwrap()).unwrap();
        assert_eq!(classes, vec!["ant", "cat"]);
        assert_eq!(train.labels(), &[0, 1, 1]);
        assert_eq!(train.image_shape(), [3, 3, 4]);
        // ant/x, cat/a, cat/b; planar: 12 red values first.
        assert_eq!(train.image(1)[0], 20);
        assert_eq!(train.image(1)[12], 21);
        assert_eq!(train.image(2)[0], 30);
        assert_eq!(test.labels(), &[1]);
    }

    #[test]
    fn greyscale_sets_stay_one_channel_and_bad_input_is_named() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        let grey =
            |v| DynamicImage::ImageLuma8(image::GrayImage::from_pixel(5, 5, image::Luma([v])));
        save(&r.join("train/0/a.png"), grey(1));
        save(&r.join("test/0/a.png"), grey(2));
        let (train, _, _) = read_image_folder(r).unwrap();
        assert_eq!(train.image_shape(), [1, 5, 5]);

        save(&r.join("test/7/b.png"), grey(3));
        let e = read_image_folder(r).unwrap_err().to_string();
        assert!(e.contains("class '7' does not exist"), "{e}");
        std::fs::remove_dir_all(r.join("test/7")).unwrap();

        let big = DynamicImage::ImageLuma8(image::GrayImage::new(6, 5));
        save(&r.join("train/0/c.png"), big);
        let e = read_image_folder(r).unwrap_err().to_string();
        assert!(e.contains("c.png") && e.contains("one size"), "{e}");
        std::fs::write(r.join("train/0/c.png"), b"not a png").unwrap();
        let e = read_image_folder(r).unwrap_err().to_string();
        assert!(e.contains("c.png") && e.contains("cannot decode"), "{e}");
    }
}
