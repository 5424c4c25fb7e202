//! Fetching a dataset's canonical files once, verified before use.
//!
//! [`sources`] lists each dataset's canonical archives with their byte size and SHA-256 (the
//! values TensorFlow Datasets records for the same URLs). [`download`] streams every file into
//! `NAME.part`, hashing as it goes, and only renames it into place when the size and digest
//! match; archives (`.tar.gz`) are then unpacked next to it, where [`load_dataset`] finds
//! them. A file already present with the right digest is not fetched again.
//!
//! FEMNIST has no canonical archive (LEAF builds it with its own scripts) and image folders are
//! the user's own, so neither can be downloaded.
//!
//! [`load_dataset`]: crate::load_dataset

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Component, Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::{DataError, DatasetKind};

/// What to do with a file once it is verified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unpack {
    /// Keep it as it is (IDX `.gz` files are read compressed, `.mat` files directly).
    Keep,
    /// Unpack a gzip-compressed tar archive into the target directory.
    TarGz,
}

/// One file to fetch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteFile {
    /// Where it is served.
    pub url: String,
    /// Its file name in the target directory.
    pub name: String,
    /// Its size in bytes.
    pub size: u64,
    /// Its SHA-256, lower-case hex.
    pub sha256: String,
    /// What to do after verification.
    pub unpack: Unpack,
}

impl RemoteFile {
    fn new(url: &str, size: u64, sha256: &str, unpack: Unpack) -> Self {
        let name = url.rsplit('/').next().unwrap_or(url).to_string();
        Self {
            url: url.to_string(),
            name,
            size,
            sha256: sha256.to_string(),
            unpack,
        }
    }

    /// The same file served from `base` (a mirror holding the canonical file names).
    pub fn from_mirror(&self, base: &str) -> Self {
        Self {
            url: format!("{}/{}", base.trim_end_matches('/'), self.name),
            ..self.clone()
        }
    }
}

/// The canonical files of `kind`.
pub fn sources(kind: DatasetKind) -> Result<Vec<RemoteFile>, DataError> {
    use Unpack::{Keep, TarGz};
    const FMNIST: &str = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com";
    const MNIST: &str = "https://storage.googleapis.com/cvdf-datasets/mnist";
    let idx = |base: &str, files: [(&str, u64, &str); 4]| {
        files
            .iter()
            .map(|(name, size, sha)| RemoteFile::new(&format!("{base}/{name}"), *size, sha, Keep))
            .collect()
    };
    Ok(match kind {
        DatasetKind::FashionMnist => idx(
            FMNIST,
            [
                (
                    "train-images-idx3-ubyte.gz",
                    26_421_880,
                    "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84",
                ),
                (
                    "train-labels-idx1-ubyte.gz",
                    29_515,
                    "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845",
                ),
                (
                    "t10k-images-idx3-ubyte.gz",
                    4_422_102,
                    "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073",
                ),
                (
                    "t10k-labels-idx1-ubyte.gz",
                    5_148,
                    "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5",
                ),
            ],
        ),
        DatasetKind::Mnist => idx(
            MNIST,
            [
                (
                    "train-images-idx3-ubyte.gz",
                    9_912_422,
                    "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
                ),
                (
                    "train-labels-idx1-ubyte.gz",
                    28_881,
                    "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
                ),
                (
                    "t10k-images-idx3-ubyte.gz",
                    1_648_877,
                    "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
                ),
                (
                    "t10k-labels-idx1-ubyte.gz",
                    4_542,
                    "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
                ),
            ],
        ),
        DatasetKind::Cifar10 => vec![RemoteFile::new(
            "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz",
            170_052_171,
            "c4a38c50a1bc5f3a1c5537f2155ab9d68f9f25eb1ed8d9ddda3db29a59bca1dd",
            TarGz,
        )],
        DatasetKind::Cifar100 | DatasetKind::Cifar100Coarse => vec![RemoteFile::new(
            "https://www.cs.toronto.edu/~kriz/cifar-100-binary.tar.gz",
            168_513_733,
            "58a81ae192c23a4be8b1804d68e518ed807d710a4eb253b1f2a199162a40d8ec",
            TarGz,
        )],
        DatasetKind::Svhn => vec![
            RemoteFile::new(
                "http://ufldl.stanford.edu/housenumbers/train_32x32.mat",
                182_040_794,
                "435e94d69a87fde4fd4d7f3dd208dfc32cb6ae8af2240d066de1df7508d083b8",
                Keep,
            ),
            RemoteFile::new(
                "http://ufldl.stanford.edu/housenumbers/test_32x32.mat",
                64_275_384,
                "cdce80dfb2a2c4c6160906d0bd7c68ec5a99d7ca4831afa54f09182025b6a75b",
                Keep,
            ),
        ],
        DatasetKind::Femnist => {
            return Err(DataError::Download(
                "FEMNIST has no canonical archive: build it with LEAF's preprocessing scripts (`./preprocess.sh -s niid --sf 0.05 -k 0 -t sample`) and pass --data-dir".into(),
            ));
        }
        DatasetKind::ImageFolder => {
            return Err(DataError::Download(
                "image folders are your own data; there is nothing to download".into(),
            ));
        }
    })
}

/// The directory `fl download` fills by default: the per-user cache that dataset resolution
/// searches (`$XDG_CACHE_HOME/fl/<name>` or `~/.cache/fl/<name>`; CIFAR-100's coarse labels
/// share CIFAR-100's folder).
pub fn default_dir(kind: DatasetKind) -> Option<PathBuf> {
    let kind = match kind {
        DatasetKind::Cifar100Coarse => DatasetKind::Cifar100,
        k => k,
    };
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(cache.join("fl").join(kind.name()))
}

/// How a download is going, for a progress bar.
pub trait Progress {
    /// A file starts: its name and size.
    fn start(&mut self, name: &str, size: u64);
    /// `bytes` more have arrived.
    fn advance(&mut self, bytes: u64);
    /// The file is verified (or was already there).
    fn finish(&mut self, name: &str);
}

/// No progress reporting.
impl Progress for () {
    fn start(&mut self, _: &str, _: u64) {}
    fn advance(&mut self, _: u64) {}
    fn finish(&mut self, _: &str) {}
}

/// Fetches, verifies and unpacks `files` into `dir` (created if needed).
pub fn download(
    files: &[RemoteFile],
    dir: &Path,
    progress: &mut dyn Progress,
) -> Result<(), DataError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| DataError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    for file in files {
        let target = dir.join(&file.name);
        if target.exists() && sha256_of(&target)? == file.sha256 {
            progress.finish(&file.name);
        } else {
            fetch(file, &target, progress)?;
            progress.finish(&file.name);
        }
        if file.unpack == Unpack::TarGz {
            unpack_tar_gz(&target, dir)?;
        }
    }
    Ok(())
}

/// The SHA-256 of a file, lower-case hex.
pub fn sha256_of(path: &Path) -> Result<String, DataError> {
    let mut f = File::open(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut hasher = Sha256::new();
    std::io::copy(&mut f, &mut hasher).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(hex(&hasher.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The local path a mirror URL names: a `file://` URL or a plain path (no `scheme://`).
pub fn local_path(url: &str) -> Option<&Path> {
    match url.strip_prefix("file://") {
        Some(path) => Some(Path::new(path)),
        None => (!url.contains("://")).then(|| Path::new(url)),
    }
}

/// A reader of `url`'s bytes: a local file, or an HTTP(S) response body.
fn open(url: &str) -> Result<Box<dyn Read>, String> {
    if let Some(path) = local_path(url) {
        return File::open(path)
            .map(|f| Box::new(f) as Box<dyn Read>)
            .map_err(|e| e.to_string());
    }
    let response = ureq::get(url).call().map_err(|e| e.to_string())?;
    Ok(Box::new(response.into_body().into_reader()))
}

/// Streams `file` into `target.part`, checks size and digest, then renames it to `target`.
fn fetch(file: &RemoteFile, target: &Path, progress: &mut dyn Progress) -> Result<(), DataError> {
    let fail = |problem: String| DataError::Download(format!("{}: {problem}", file.url));
    let part = target.with_file_name(format!("{}.part", file.name));
    let mut body = open(&file.url).map_err(fail)?;
    let out = File::create(&part).map_err(|source| DataError::Io {
        path: part.clone(),
        source,
    })?;
    let mut out = BufWriter::new(out);
    let mut hasher = Sha256::new();
    let mut received = 0u64;
    let mut buf = vec![0u8; 1 << 16];
    progress.start(&file.name, file.size);
    let result = (|| {
        loop {
            let n = body.read(&mut buf).map_err(|e| fail(e.to_string()))?;
            if n == 0 {
                break;
            }
            received += n as u64;
            if received > file.size {
                return Err(fail(format!("more than the expected {} bytes", file.size)));
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n]).map_err(|source| DataError::Io {
                path: part.clone(),
                source,
            })?;
            progress.advance(n as u64);
        }
        out.flush().map_err(|source| DataError::Io {
            path: part.clone(),
            source,
        })?;
        if received != file.size {
            return Err(fail(format!(
                "got {received} bytes, expected {}: an interrupted transfer, or not the canonical file",
                file.size
            )));
        }
        let digest = hex(&hasher.finalize_reset());
        if digest != file.sha256 {
            return Err(fail(format!(
                "SHA-256 is {digest}, expected {}; the file is corrupt or not the canonical one",
                file.sha256
            )));
        }
        Ok(())
    })();
    drop(out);
    if let Err(e) = result {
        let _ = std::fs::remove_file(&part);
        return Err(e);
    }
    std::fs::rename(&part, target).map_err(|source| DataError::Io {
        path: target.to_path_buf(),
        source,
    })
}

/// Unpacks a `.tar.gz` into `dir`, refusing entries that would land outside it.
fn unpack_tar_gz(archive: &Path, dir: &Path) -> Result<(), DataError> {
    let bad = |problem: String| DataError::corrupt(archive, problem);
    let f = File::open(archive).map_err(|source| DataError::Io {
        path: archive.to_path_buf(),
        source,
    })?;
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(f));
    let entries = tar.entries().map_err(|e| bad(e.to_string()))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| bad(e.to_string()))?;
        let path = entry.path().map_err(|e| bad(e.to_string()))?.into_owned();
        if path
            .components()
            .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
        {
            return Err(bad(format!("unsafe path in archive: {}", path.display())));
        }
        entry
            .unpack_in(dir)
            .map_err(|e| bad(format!("{}: {e}", path.display())))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader};
    use std::net::TcpListener;

    /// Serves `body` to every request on a loopback port (for `requests` requests).
    fn serve(body: Vec<u8>, requests: usize) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for stream in listener.incoming().take(requests) {
                let mut stream = stream.unwrap();
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut line = String::new();
                while reader.read_line(&mut line).unwrap() > 0 && line != "\r\n" {
                    line.clear();
                }
                let head = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                stream.write_all(head.as_bytes()).unwrap();
                stream.write_all(&body).unwrap();
            }
        });
        format!("http://{addr}")
    }

    fn remote(base: &str, name: &str, body: &[u8], unpack: Unpack) -> RemoteFile {
        RemoteFile {
            url: format!("{base}/{name}"),
            name: name.into(),
            size: body.len() as u64,
            sha256: hex(&Sha256::digest(body)),
            unpack,
        }
    }

    #[test]
    fn a_local_mirror_is_a_directory_or_a_file_url() {
        let mirror = tempfile::tempdir().unwrap();
        let body = b"mirrored bytes".to_vec();
        std::fs::write(mirror.path().join("m.bin"), &body).unwrap();
        let plain = mirror.path().display().to_string();
        for base in [plain.clone(), format!("file://{plain}")] {
            let dir = tempfile::tempdir().unwrap();
            let file = remote(&base, "m.bin", &body, Unpack::Keep);
            download(&[file], dir.path(), &mut ()).unwrap();
            assert_eq!(std::fs::read(dir.path().join("m.bin")).unwrap(), body);
        }
        // Verified all the same: other bytes under the canonical name are refused.
        let dir = tempfile::tempdir().unwrap();
        let mut file = remote(&plain, "m.bin", &body, Unpack::Keep);
        file.sha256 = "0".repeat(64);
        let err = download(&[file], dir.path(), &mut ())
            .unwrap_err()
            .to_string();
        assert!(err.contains("SHA-256"), "{err}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        assert_eq!(local_path("https://x/y"), None);
    }

    #[test]
    fn a_verified_file_lands_and_is_not_fetched_twice() {
        let body = b"canonical bytes".to_vec();
        let base = serve(body.clone(), 1);
        let dir = tempfile::tempdir().unwrap();
        let file = remote(&base, "a.bin", &body, Unpack::Keep);
        download(std::slice::from_ref(&file), dir.path(), &mut ()).unwrap();
        assert_eq!(std::fs::read(dir.path().join("a.bin")).unwrap(), body);
        // The server answers only once: a second download must use the verified copy.
        download(&[file], dir.path(), &mut ()).unwrap();
    }

    #[test]
    fn wrong_digest_or_size_is_an_error_and_leaves_nothing() {
        let body = b"tampered bytes".to_vec();
        let dir = tempfile::tempdir().unwrap();
        let base = serve(body.clone(), 2);
        let mut file = remote(&base, "b.bin", &body, Unpack::Keep);
        file.sha256 = "0".repeat(64);
        let err = download(std::slice::from_ref(&file), dir.path(), &mut ())
            .unwrap_err()
            .to_string();
        assert!(err.contains("SHA-256") && err.contains("b.bin"), "{err}");
        let mut file = remote(&base, "b.bin", &body, Unpack::Keep);
        file.size += 10;
        let err = download(&[file], dir.path(), &mut ())
            .unwrap_err()
            .to_string();
        assert!(err.contains("interrupted"), "{err}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    #[test]
    fn an_unreachable_server_is_a_clear_error() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let dir = tempfile::tempdir().unwrap();
        let file = remote(&format!("http://{addr}"), "c.bin", b"x", Unpack::Keep);
        let err = download(&[file], dir.path(), &mut ())
            .unwrap_err()
            .to_string();
        assert!(err.contains(&addr.to_string()), "{err}");
    }

    /// A CIFAR-10 binary archive (a small fixture in the real layout) is fetched, verified,
    /// unpacked and then read by the CIFAR reader; an archive escaping its folder is refused.
    #[test]
    fn a_cifar_archive_unpacks_where_the_reader_finds_it() {
        let mut tar = tar::Builder::new(Vec::new());
        let record = |label: u8| {
            let mut r = vec![label];
            r.extend(std::iter::repeat_n(label.wrapping_mul(20), 3072));
            r
        };
        for name in (1..=5)
            .map(|i| format!("data_batch_{i}.bin"))
            .chain(["test_batch.bin".to_string()])
        {
            let data: Vec<u8> = (0..4u8).flat_map(record).collect();
            let mut header = tar::Header::new_gnu();
            header.set_size(data.len() as u64);
            header.set_mode(0o644);
            header.set_cksum();
            tar.append_data(
                &mut header,
                format!("cifar-10-batches-bin/{name}"),
                &data[..],
            )
            .unwrap();
        }
        let tar = tar.into_inner().unwrap();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&tar).unwrap();
        let body = gz.finish().unwrap();
        let base = serve(body.clone(), 1);
        let dir = tempfile::tempdir().unwrap();
        let file = remote(&base, "cifar-10-binary.tar.gz", &body, Unpack::TarGz);
        download(&[file], dir.path(), &mut ()).unwrap();
        let data = crate::load_dataset(DatasetKind::Cifar10, Some(dir.path())).unwrap();
        assert_eq!((data.train.len(), data.test.len()), (20, 4));

        let mut evil = tar::Builder::new(Vec::new());
        let mut header = tar::Header::new_gnu();
        header.set_size(1);
        header.set_mode(0o644);
        header.set_cksum();
        // Written through the raw header so the builder does not normalise the path away.
        let mut header2 = header.clone();
        header2.as_gnu_mut().unwrap().name[..9].copy_from_slice(b"../x.bin\0");
        header2.set_cksum();
        evil.append(&header2, &b"x"[..]).unwrap();
        let archive = dir.path().join("evil.tar.gz");
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&evil.into_inner().unwrap()).unwrap();
        std::fs::write(&archive, gz.finish().unwrap()).unwrap();
        let err = unpack_tar_gz(&archive, &dir.path().join("inner"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("unsafe path"), "{err}");
    }

    #[test]
    fn every_canonical_source_is_well_formed() {
        for &kind in DatasetKind::all() {
            match sources(kind) {
                Ok(files) => {
                    assert!(!files.is_empty(), "{kind}");
                    for f in files {
                        assert_eq!(f.sha256.len(), 64, "{}", f.url);
                        assert!(f.sha256.chars().all(|c| c.is_ascii_hexdigit()));
                        assert!(f.url.starts_with("http") && f.size > 0);
                        assert!(f.url.ends_with(&f.name));
                    }
                }
                Err(e) => assert!(
                    matches!(kind, DatasetKind::Femnist | DatasetKind::ImageFolder),
                    "{kind}: {e}"
                ),
            }
        }
    }
}
