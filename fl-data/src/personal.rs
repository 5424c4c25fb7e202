//! The split of personalised FL (pFedHR, pFedClub): a server-side public set, and per client a
//! training and a test portion of the client's own data.

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use crate::{DataError, Dataset, FederatedDataset, Partition, PartitionScheme};

/// Indices into one pooled dataset: the public set and each client's train and test portions.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PersonalSplit {
    /// The server's public samples.
    pub public: Vec<usize>,
    /// `train[i]`: client `i`'s training samples.
    pub train: Vec<Vec<usize>>,
    /// `test[i]`: client `i`'s test samples (its accuracy is measured on these).
    pub test: Vec<Vec<usize>>,
}

impl PersonalSplit {
    /// What the engine needs to run over this split of `pooled` (the samples it indexes,
    /// drawn from `data`): a dataset whose train and test sets are both the pooled samples, and
    /// the clients' training portions as the partition. Each client is evaluated on its own
    /// test portion, [`test`](Self::test).
    pub fn engine_data(
        &self,
        data: &FederatedDataset,
        pooled: &Dataset,
    ) -> (FederatedDataset, Partition) {
        let personal = FederatedDataset {
            train: pooled.clone(),
            test: pooled.clone(),
            natural_clients: None,
            ..data.clone()
        };
        let partition = Partition {
            clients: self.train.clone(),
        };
        (personal, partition)
    }

    /// Splits samples with `labels` as pFedClub does (72% train / 20% test / 8% public with
    /// `public_fraction = 0.08`, `test_fraction = 0.2`): a random `public_fraction` of all
    /// samples goes to the server; the rest is split among `num_clients` clients by `scheme`
    /// (IID, or pathological with 2 classes per client); then each client's samples are split
    /// at random into train and test so that the test portions make up `test_fraction` of all
    /// samples. A client's test data thus follows its own label distribution.
    pub fn new(
        scheme: &PartitionScheme,
        labels: &[u16],
        num_classes: usize,
        num_clients: usize,
        public_fraction: f64,
        test_fraction: f64,
        seed: u64,
    ) -> Result<Self, DataError> {
        let bad = |m: String| Err(DataError::Partition(m));
        if !(0.0..1.0).contains(&public_fraction) {
            return bad(format!(
                "the public fraction must be in [0, 1), got {public_fraction}"
            ));
        }
        if !(test_fraction > 0.0 && public_fraction + test_fraction < 1.0) {
            return bad(format!(
                "the test fraction must be > 0 and leave training data next to the public \
                 fraction {public_fraction}, got {test_fraction}"
            ));
        }
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut order: Vec<usize> = (0..labels.len()).collect();
        order.shuffle(&mut rng);
        let num_public = (public_fraction * labels.len() as f64).round() as usize;
        let (public, private) = order.split_at(num_public);
        let private_labels: Vec<u16> = private.iter().map(|&i| labels[i]).collect();
        let partition = Partition::new(
            scheme,
            &private_labels,
            num_classes,
            num_clients,
            seed.wrapping_add(1),
        )?;
        // Within a client, test / (train + test) = test_fraction / (1 − public_fraction).
        let test_share = test_fraction / (1.0 - public_fraction);
        let (mut train, mut test) = (Vec::new(), Vec::new());
        for (c, local) in partition.clients.into_iter().enumerate() {
            let mut samples: Vec<usize> = local.into_iter().map(|i| private[i]).collect();
            samples.shuffle(&mut rng);
            let n_test = (test_share * samples.len() as f64).round() as usize;
            if n_test == 0 || n_test == samples.len() {
                return bad(format!(
                    "client {c} has {} samples, too few for both a training and a test portion; \
                     use fewer clients",
                    samples.len()
                ));
            }
            test.push(samples.split_off(samples.len() - n_test));
            train.push(samples);
        }
        let mut public = public.to_vec();
        public.sort_unstable();
        Ok(Self {
            public,
            train,
            test,
        })
    }

    /// Number of clients.
    pub fn num_clients(&self) -> usize {
        self.train.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(n: usize) -> Vec<u16> {
        (0..n).map(|i| (i * 7 % 10) as u16).collect()
    }

    #[test]
    fn split_is_disjoint_complete_and_in_proportion() {
        let labels = labels(7000);
        for scheme in [
            PartitionScheme::Iid,
            PartitionScheme::Pathological {
                classes_per_client: 2,
            },
        ] {
            let s = PersonalSplit::new(&scheme, &labels, 10, 50, 0.08, 0.2, 3).unwrap();
            let mut seen = vec![0u8; labels.len()];
            for &i in s
                .public
                .iter()
                .chain(s.train.iter().flatten())
                .chain(s.test.iter().flatten())
            {
                seen[i] += 1;
            }
            assert!(
                seen.iter().all(|&k| k == 1),
                "every sample used exactly once"
            );
            assert_eq!(s.public.len(), 560);
            let test: usize = s.test.iter().map(Vec::len).sum();
            assert!((1350..1450).contains(&test), "test portion {test} ≈ 20%");
            for c in 0..50 {
                assert!(!s.train[c].is_empty() && !s.test[c].is_empty());
                if matches!(scheme, PartitionScheme::Pathological { .. }) {
                    // A client's test labels come from its own two classes.
                    let classes = |v: &[usize]| {
                        let mut k: Vec<u16> = v.iter().map(|&i| labels[i]).collect();
                        k.sort_unstable();
                        k.dedup();
                        k
                    };
                    assert_eq!(classes(&s.train[c]).len(), 2);
                    assert!(
                        classes(&s.test[c])
                            .iter()
                            .all(|k| classes(&s.train[c]).contains(k))
                    );
                }
            }
            let again = PersonalSplit::new(&scheme, &labels, 10, 50, 0.08, 0.2, 3).unwrap();
            assert_eq!(s, again, "deterministic in the seed");
        }
    }

    #[test]
    fn impossible_splits_are_clear_errors() {
        let labels = labels(100);
        let iid = PartitionScheme::Iid;
        for (public, test) in [(1.0, 0.2), (-0.1, 0.2), (0.08, 0.0), (0.5, 0.5)] {
            let err = PersonalSplit::new(&iid, &labels, 10, 5, public, test, 0).unwrap_err();
            assert!(err.to_string().contains("fraction"), "{err}");
        }
        let err = PersonalSplit::new(&iid, &labels, 10, 90, 0.08, 0.2, 0).unwrap_err();
        assert!(err.to_string().contains("too few"), "{err}");
    }
}
