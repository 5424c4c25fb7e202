//! The dataset readers end to end: each dataset from its native file format (small
//! generated fixtures), and clear errors for corrupt files.

mod common;

use std::path::Path;

use common::*;

#[test]
fn mnist_from_a_data_dir_and_corrupt_files() {
    let dir = tmp();
    let data = dir.path().join("mnist");
    std::fs::create_dir(&data).unwrap();
    write_idx_fixture(&data, 400);
    let out = dir.path().join("run").display().to_string();
    let data_arg = data.display().to_string();
    let mut base = words(
        "fedavg --dataset mnist --clients 4 --sample 2 --rounds 2 --local-epochs 2 --partition iid --lr 0.05 --quiet",
    );
    base.extend(["--data-dir", &data_arg, "--out", &out]);
    let o = fl(&base);
    assert!(o.status.success(), "{}", stderr(&o));
    let m = metrics(Path::new(&out));
    assert!(
        m[1]["test_acc"].as_f64().unwrap() > 0.5,
        "fixture not learned: {m:?}"
    );

    // Truncate the training images: a clear error naming the file.
    let images = data.join("train-images-idx3-ubyte");
    let bytes = std::fs::read(&images).unwrap();
    std::fs::write(&images, &bytes[..bytes.len() - 10]).unwrap();
    let out2 = dir.path().join("run2").display().to_string();
    let mut args = base.to_vec();
    *args.last_mut().unwrap() = &out2;
    let o = fl(&args);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("train-images-idx3-ubyte") && err.contains("payload"),
        "{err}"
    );
}

#[test]
fn cifar10_svhn_and_femnist_run_from_their_native_formats() {
    let dir = tmp();
    let cifar = dir.path().join("cifar");
    write_cifar10_fixture(&cifar, 40);
    let out = dir.path().join("cifar-run");
    let o = one_round_on("cifar10", &cifar, &out);
    assert!(o.status.success(), "{}", stderr(&o));
    let m = metrics(&out);
    // The 3-channel cnn: 62,006 parameters per model, 2 clients each way.
    assert_eq!(m[0]["bytes_down"], 2 * 62_006 * 4);

    // CIFAR-100's binary files (coarse label, fine label, pixels), trained on the 20 coarse
    // classes as the FedMR/FedCross code does: the cnn's head has 20 outputs.
    let c100 = dir.path().join("c100").join("cifar-100-binary");
    std::fs::create_dir_all(&c100).unwrap();
    for (file, n) in [("train.bin", 40u8), ("test.bin", 10)] {
        let bytes: Vec<u8> = (0..n)
            .flat_map(|i| {
                let mut r = vec![i % 20, (i * 3) % 100];
                r.extend(std::iter::repeat_n(i * 6, 3072));
                r
            })
            .collect();
        std::fs::write(c100.join(file), bytes).unwrap();
    }
    let out = dir.path().join("c100-run");
    let o = one_round_on("cifar100-coarse", &dir.path().join("c100"), &out);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(metrics(&out)[0]["bytes_down"], 2 * (62_006 + 85 * 10) * 4);

    // SVHN's MATLAB files (compressed, as distributed), found in an `svhn/` subfolder.
    let svhn = dir.path().join("data").join("svhn");
    std::fs::create_dir_all(&svhn).unwrap();
    for (file, n) in [("train_32x32.mat", 40), ("test_32x32.mat", 10)] {
        let images: Vec<Vec<u8>> = (0..n)
            .map(|i| (0..3072).map(|p| ((p * 13 + i * 29) % 256) as u8).collect())
            .collect();
        let labels: Vec<f64> = (0..n).map(|i| (i % 10 + 1) as f64).collect();
        fl_data::svhn::write_fixture(&svhn.join(file), &images, &labels, true).unwrap();
    }
    let out = dir.path().join("svhn-run");
    let o = one_round_on("svhn", &dir.path().join("data"), &out);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(metrics(&out).len(), 1);

    let femnist = dir.path().join("leaf");
    write_femnist_fixture(&femnist, 6, |_| 5);
    let run = |clients: &str, partition: &str, out: &Path| {
        fl_line(
            "fedmr --dataset femnist --sample 2 --rounds 1 --local-epochs 1 --quiet",
            &[
                "--data-dir",
                &femnist.display().to_string(),
                "--clients",
                clients,
                "--partition",
                partition,
                "--out",
                &out.display().to_string(),
            ],
        )
    };
    let out = dir.path().join("femnist-run");
    let o = run("6", "natural", &out);
    assert!(o.status.success(), "{}", stderr(&o));
    // One client per writer, 5 samples each; the 62-class cnn has 160,510 parameters.
    let sizes = client_sizes(&out);
    assert_eq!(sizes, vec![5; 6]);
    assert_eq!(metrics(&out)[0]["bytes_up"], 2 * 160_510 * 4);
    let o = run("7", "natural", &dir.path().join("too-many"));
    assert!(
        stderr(&o).contains("more than the 6 writers"),
        "{}",
        stderr(&o)
    );
    // `--clients 0`: every writer; `--sample-fraction`: the FedMR authors' `--frac`.
    let all = dir.path().join("all-writers");
    let o = fl_line(
        "fedavg --dataset femnist --clients 0 --sample-fraction 0.5 --partition natural --rounds 1 --local-epochs 1 --quiet",
        &[
            "--data-dir",
            &femnist.display().to_string(),
            "--out",
            &all.display().to_string(),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(metrics(&all)[0]["clients"].as_array().unwrap().len(), 3);
    let config = std::fs::read_to_string(all.join("config.toml")).unwrap();
    assert!(
        config.contains("clients = 6") && config.contains("sample = 3"),
        "{config}"
    );
    // Only writers with enough samples (the FedMR paper's LEAF `-k 100`, here 6): writers of
    // 3..8 samples leave the three with 6, 7 and 8.
    let uneven = dir.path().join("leaf-uneven");
    write_femnist_fixture(&uneven, 6, |w| 3 + w);
    let kept = dir.path().join("kept-writers");
    let o = fl_line(
        "fedavg --dataset femnist --clients 0 --sample 2 --partition natural --min-writer-samples 6 --rounds 1 --local-epochs 1 --quiet",
        &[
            "--data-dir",
            &uneven.display().to_string(),
            "--out",
            &kept.display().to_string(),
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let sizes = client_sizes(&kept);
    assert_eq!(sizes, [6, 7, 8]);
    let o = fl_line(
        "fedavg --partition natural --rounds 1 --quiet",
        &[
            "--out",
            &dir.path().join("no-natural").display().to_string(),
        ],
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("needs a dataset with its own client split"),
        "{}",
        stderr(&o)
    );
}

/// The number of samples of each client in a run's `partition.json`.
fn client_sizes(out: &std::path::Path) -> Vec<usize> {
    let partition: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("partition.json")).unwrap())
            .unwrap();
    partition["clients"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_array().unwrap().len())
        .collect()
}

/// An image folder of the user's own small images (8×8 greyscale PNGs): the models that fit
/// are listed and train, those that do not are refused before anything is written.
#[test]
fn an_image_folder_of_small_images_runs_on_the_models_that_fit() {
    let dir = tmp();
    let data = dir.path().join("imgs");
    for (split, per_class) in [("train", 12), ("test", 4)] {
        for class in ["ant", "bee", "cat"] {
            let folder = data.join(split).join(class);
            std::fs::create_dir_all(&folder).unwrap();
            for i in 0..per_class {
                let img = image::GrayImage::from_fn(8, 8, |x, y| {
                    image::Luma([((x * 31 + y * 17 + i * 7) % 256) as u8])
                });
                img.save(folder.join(format!("{i:02}.png"))).unwrap();
            }
        }
    }
    let data_s = data.display().to_string();
    let o = fl(&["models", "--dataset", "image-folder", "--data-dir", &data_s]);
    assert!(o.status.success(), "{}", stderr(&o));
    let listing = String::from_utf8_lossy(&o.stdout);
    assert!(
        listing.contains("cnn          needs images of at least 16×16 pixels"),
        "{listing}"
    );
    assert!(listing.contains("  conv1      [1, 8, 8]"), "{listing}");
    fails(
        &["models", "--data-dir", &data_s],
        "--data-dir applies only to --dataset image-folder",
    );
    let run = |model: &str, out: &Path| {
        fl_line(
            &format!(
                "fedavg --dataset image-folder --model {model} --clients 3 --sample 2 --rounds 1 \
                 --local-epochs 1 --batch-size 8 --partition iid --quiet"
            ),
            &["--data-dir", &data_s, "--out", &out.display().to_string()],
        )
    };
    let refused = dir.path().join("cnn");
    let o = run("cnn", &refused);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("cnn needs images of at least 16×16 pixels, got 1×8×8"),
        "{}",
        stderr(&o)
    );
    assert!(!refused.exists());
    // CNN3's three pools take 8×8 images to 1×1 maps under 5×5 convolutions.
    let cnn3 = dir.path().join("cnn3");
    let o = run("cnn3", &cnn3);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(metrics(&cnn3).len(), 1);
}
