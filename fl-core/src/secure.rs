//! Secure recombination for FedMR (the paper's Appendix B): the clients recombine their models
//! among themselves before upload, so the server learns the recombined models but not which
//! client each layer came from.
//!
//! Protocol, per round, for the K sampled clients and the model's units (tensors, layers or
//! blocks, as in plain recombination):
//! 1. The server publishes a fresh X25519 public key. Every client encrypts each of its units to
//!    that key with HPKE (RFC 9180: DHKEM(X25519, HKDF-SHA256), HKDF-SHA256, ChaCha20-Poly1305),
//!    binding the unit index as associated data. Relaying clients cannot read a payload, and a
//!    payload moved to another unit slot or altered fails authentication at the server.
//! 2. Exchange passes: in each pass every client offers a random subset of its units (each unit
//!    with probability 1/2); for each offered unit it sends its ciphertext to a random other
//!    client. The receiver puts it into its buffer for that unit, next to the ciphertext it
//!    holds, and returns one of the two, chosen at random, to the sender. Each client always
//!    ends a step holding exactly one ciphertext per unit, so the multiset of units — and the
//!    sum of all models — is preserved, exactly as in plain recombination.
//! 3. Every client uploads the ciphertexts it holds; the server decrypts and assembles one model
//!    per client.
//!
//! The protocol's choices come from the round's seeded RNG (results are reproducible); keys and
//! HPKE's ephemeral secrets come from the operating system's CSPRNG, since they must be secret.
//! Ciphertexts are 16 bytes (tag) plus a 32-byte encapsulated key longer than the payload.

use hpke::aead::ChaCha20Poly1305;
use hpke::kdf::HkdfSha256;
use hpke::kem::X25519HkdfSha256;
use hpke::{Deserializable, Kem, OpModeR, OpModeS, Serializable};
use rand::Rng;

use crate::layers::{Granularity, LayerError, ParamTable};

/// HPKE context string: binds ciphertexts to this protocol.
const INFO: &[u8] = b"fl secure FedMR layer exchange v1";

type ServerKem = X25519HkdfSha256;

/// Errors of the secure exchange.
#[derive(Debug, thiserror::Error)]
pub enum SecureError {
    /// A table operation failed.
    #[error(transparent)]
    Layer(#[from] LayerError),
    /// Encryption failed.
    #[error("encrypting unit {unit}: {reason}")]
    Seal {
        /// Unit index.
        unit: usize,
        /// HPKE's reason.
        reason: String,
    },
    /// A ciphertext did not authenticate: wrong key, altered bytes or moved to another unit.
    #[error("unit {unit}: ciphertext rejected ({reason})")]
    Open {
        /// Unit index.
        unit: usize,
        /// HPKE's reason.
        reason: String,
    },
    /// A decrypted payload has the wrong length for the unit's tensors.
    #[error("unit {unit}: payload of {got} bytes, expected {expected}")]
    Length {
        /// Unit index.
        unit: usize,
        /// Bytes received.
        got: usize,
        /// Bytes the layout implies.
        expected: usize,
    },
    /// Fewer than two clients cannot exchange anything.
    #[error("secure exchange needs at least 2 clients, got {0}")]
    TooFewClients(usize),
}

/// The server's key pair for one round.
pub struct ServerKeys {
    secret: <ServerKem as Kem>::PrivateKey,
    public: <ServerKem as Kem>::PublicKey,
}

impl ServerKeys {
    /// A fresh key pair from the operating system's CSPRNG.
    pub fn generate() -> Self {
        let (secret, public) = ServerKem::gen_keypair();
        Self { secret, public }
    }

    /// The public key clients encrypt to, as bytes.
    pub fn public_bytes(&self) -> Vec<u8> {
        self.public.to_bytes().to_vec()
    }
}

impl std::fmt::Debug for ServerKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret key.
        f.debug_struct("ServerKeys")
            .field("public", &self.public_bytes())
            .finish_non_exhaustive()
    }
}

/// One unit's payload, encrypted to the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SealedUnit {
    /// HPKE encapsulated key (the sender's ephemeral X25519 public key).
    pub encapped_key: Vec<u8>,
    /// ChaCha20-Poly1305 ciphertext with its tag.
    pub ciphertext: Vec<u8>,
}

impl SealedUnit {
    /// Bytes on the wire.
    pub fn wire_bytes(&self) -> usize {
        self.encapped_key.len() + self.ciphertext.len()
    }
}

fn aad(unit: usize) -> [u8; 8] {
    (unit as u64).to_le_bytes()
}

/// Encrypts the values of unit `unit` (its tensors, concatenated, as little-endian f32) to the
/// server's public key.
pub fn seal_unit(
    keys: &ServerKeys,
    unit: usize,
    values: &[&[f32]],
) -> Result<SealedUnit, SecureError> {
    let plaintext: Vec<u8> = values
        .iter()
        .flat_map(|t| t.iter().flat_map(|x| x.to_le_bytes()))
        .collect();
    let (encapped, ciphertext) = hpke::single_shot_seal::<ChaCha20Poly1305, HkdfSha256, ServerKem>(
        &OpModeS::Base,
        &keys.public,
        INFO,
        &plaintext,
        &aad(unit),
    )
    .map_err(|e| SecureError::Seal {
        unit,
        reason: e.to_string(),
    })?;
    Ok(SealedUnit {
        encapped_key: encapped.to_bytes().to_vec(),
        ciphertext,
    })
}

/// Decrypts unit `unit` and splits it into tensors of the given element counts.
pub fn open_unit(
    keys: &ServerKeys,
    unit: usize,
    sealed: &SealedUnit,
    lengths: &[usize],
) -> Result<Vec<Vec<f32>>, SecureError> {
    let reject = |e: hpke::HpkeError| SecureError::Open {
        unit,
        reason: e.to_string(),
    };
    let encapped =
        <ServerKem as Kem>::EncappedKey::from_bytes(&sealed.encapped_key).map_err(reject)?;
    let plaintext = hpke::single_shot_open::<ChaCha20Poly1305, HkdfSha256, ServerKem>(
        &OpModeR::Base,
        &keys.secret,
        &encapped,
        INFO,
        &sealed.ciphertext,
        &aad(unit),
    )
    .map_err(reject)?;
    let expected = 4 * lengths.iter().sum::<usize>();
    if plaintext.len() != expected {
        return Err(SecureError::Length {
            unit,
            got: plaintext.len(),
            expected,
        });
    }
    let mut floats = plaintext
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    Ok(lengths
        .iter()
        .map(|&n| floats.by_ref().take(n).collect())
        .collect())
}

/// Settings of the exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SecureExchange {
    /// Exchange passes per round (each client offers each unit with probability 1/2 per pass).
    pub passes: usize,
}

impl Default for SecureExchange {
    fn default() -> Self {
        Self { passes: 3 }
    }
}

/// What one secure exchange produced.
#[derive(Debug, Clone)]
pub struct ExchangeOutcome {
    /// One model per client, as the server assembles it from the uploads.
    pub models: Vec<ParamTable>,
    /// `origins[unit][client]`: whose unit the client uploaded (simulation bookkeeping for tests
    /// and analysis; in a deployment nobody learns it).
    pub origins: Vec<Vec<usize>>,
    /// Client-to-client bytes (offers and returns).
    pub exchange_bytes: u64,
    /// Bytes of the encrypted uploads to the server.
    pub upload_bytes: u64,
    /// Number of offers made.
    pub offers: usize,
}

impl SecureExchange {
    /// Runs the protocol on the clients' trained models (in client order).
    pub fn run<R: Rng>(
        &self,
        uploads: &[ParamTable],
        granularity: Granularity,
        keys: &ServerKeys,
        rng: &mut R,
    ) -> Result<ExchangeOutcome, SecureError> {
        let k = uploads.len();
        if k < 2 {
            return Err(SecureError::TooFewClients(k));
        }
        let first = &uploads[0];
        let units = first.units(granularity)?;
        let lengths: Vec<Vec<usize>> = units
            .iter()
            .map(|u| u.iter().map(|&t| first.values()[t].dims()[0]).collect())
            .collect();

        // 1. Each client encrypts its units to the server.
        let mut held: Vec<Vec<(SealedUnit, usize)>> = Vec::with_capacity(k);
        for (client, table) in uploads.iter().enumerate() {
            let host = table.to_host()?;
            let sealed = units
                .iter()
                .enumerate()
                .map(|(u, tensors)| {
                    let parts: Vec<&[f32]> = tensors.iter().map(|&t| host[t].as_slice()).collect();
                    Ok((seal_unit(keys, u, &parts)?, client))
                })
                .collect::<Result<Vec<_>, SecureError>>()?;
            held.push(sealed);
        }

        // 2. Exchange passes: offer, buffer, return one at random.
        let (mut exchange_bytes, mut offers) = (0u64, 0usize);
        for _ in 0..self.passes {
            for sender in 0..k {
                for unit in 0..units.len() {
                    if !rng.random_bool(0.5) {
                        continue;
                    }
                    let mut receiver = rng.random_range(0..k - 1);
                    if receiver >= sender {
                        receiver += 1;
                    }
                    offers += 1;
                    // The offer and the returned ciphertext both cross the network.
                    exchange_bytes += held[sender][unit].0.wire_bytes() as u64;
                    let keep_offer = rng.random_bool(0.5);
                    if keep_offer {
                        // The receiver keeps the offered unit and returns the one it held.
                        let (a, b) = two_mut(&mut held, sender, receiver);
                        std::mem::swap(&mut a[unit], &mut b[unit]);
                    }
                    exchange_bytes += held[sender][unit].0.wire_bytes() as u64;
                }
            }
        }

        // 3. Upload and server-side decryption.
        let upload_bytes: u64 = held
            .iter()
            .flatten()
            .map(|(s, _)| s.wire_bytes() as u64)
            .sum();
        let device = first.device();
        let mut models = Vec::with_capacity(k);
        for client_units in &held {
            let mut host: Vec<Vec<f32>> = vec![Vec::new(); first.values().len()];
            for (u, (sealed, _)) in client_units.iter().enumerate() {
                let opened = open_unit(keys, u, sealed, &lengths[u])?;
                for (&t, values) in units[u].iter().zip(opened) {
                    host[t] = values;
                }
            }
            models.push(first.from_host(host, &device)?);
        }
        let origins = (0..units.len())
            .map(|u| held.iter().map(|c| c[u].1).collect())
            .collect();
        Ok(ExchangeOutcome {
            models,
            origins,
            exchange_bytes,
            upload_bytes,
            offers,
        })
    }
}

/// Mutable references to two distinct elements.
fn two_mut<T>(v: &mut [T], a: usize, b: usize) -> (&mut T, &mut T) {
    assert_ne!(a, b);
    if a < b {
        let (lo, hi) = v.split_at_mut(b);
        (&mut lo[a], &mut hi[0])
    } else {
        let (lo, hi) = v.split_at_mut(a);
        (&mut hi[0], &mut lo[b])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_model::tiny;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn tables(k: u64) -> Vec<ParamTable> {
        (1..=k).map(|s| ParamTable::from_module(&tiny(s))).collect()
    }

    #[test]
    fn exchange_preserves_every_unit_and_the_sum() {
        let ups = tables(4);
        let keys = ServerKeys::generate();
        let mut rng = ChaCha8Rng::seed_from_u64(5);
        let out = SecureExchange { passes: 3 }
            .run(&ups, Granularity::Layer, &keys, &mut rng)
            .unwrap();
        let units = ups[0].units(Granularity::Layer).unwrap();
        let up_host: Vec<_> = ups.iter().map(|t| t.to_host().unwrap()).collect();
        let out_host: Vec<_> = out.models.iter().map(|t| t.to_host().unwrap()).collect();
        let mut moved = 0;
        for (u, tensors) in units.iter().enumerate() {
            // Every client's unit u is exactly the original unit of the client named in origins.
            let mut origins = out.origins[u].clone();
            for (client, &origin) in out.origins[u].iter().enumerate() {
                for &t in tensors {
                    assert_eq!(out_host[client][t], up_host[origin][t]);
                }
                moved += usize::from(client != origin);
            }
            origins.sort();
            assert_eq!(origins, vec![0, 1, 2, 3], "unit {u} lost or duplicated");
        }
        assert!(moved > 0, "nothing was exchanged");
        let sum = |ts: &[ParamTable]| {
            ParamTable::average(ts, None)
                .unwrap()
                .to_host()
                .unwrap()
                .concat()
        };
        for (a, b) in sum(&ups).iter().zip(sum(&out.models)) {
            assert!((a - b).abs() <= 1e-6 * (1.0 + a.abs()));
        }
        assert!(out.offers > 0 && out.exchange_bytes > 0);
        // Each upload carries the payload plus the 32-byte key and 16-byte tag per unit.
        let payload: usize = ups[0].byte_size() * 4;
        assert_eq!(out.upload_bytes as usize, payload + 4 * units.len() * 48);
    }

    #[test]
    fn exchange_is_deterministic_for_a_seed() {
        let ups = tables(3);
        let keys = ServerKeys::generate();
        let run = || {
            SecureExchange::default()
                .run(
                    &ups,
                    Granularity::Tensor,
                    &keys,
                    &mut ChaCha8Rng::seed_from_u64(9),
                )
                .unwrap()
        };
        let (a, b) = (run(), run());
        assert_eq!(a.origins, b.origins);
        assert_eq!(a.exchange_bytes, b.exchange_bytes);
    }

    #[test]
    fn ciphertexts_need_the_server_key_and_reject_tampering() {
        let keys = ServerKeys::generate();
        let values = [1.5f32, -2.0, 3.25];
        let sealed = seal_unit(&keys, 7, &[&values[..2], &values[2..]]).unwrap();
        assert_eq!(
            open_unit(&keys, 7, &sealed, &[2, 1]).unwrap(),
            vec![vec![1.5, -2.0], vec![3.25]]
        );
        // The plaintext is not visible in the ciphertext.
        let plain: Vec<u8> = values.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert!(!sealed.ciphertext.windows(4).any(|w| w == &plain[..4]));
        // Another key cannot open it.
        let other = ServerKeys::generate();
        assert!(matches!(
            open_unit(&other, 7, &sealed, &[2, 1]),
            Err(SecureError::Open { .. })
        ));
        // A flipped bit is rejected.
        let mut tampered = sealed.clone();
        tampered.ciphertext[0] ^= 1;
        assert!(open_unit(&keys, 7, &tampered, &[2, 1]).is_err());
        // So is moving the payload to another unit slot (the unit index is authenticated).
        assert!(open_unit(&keys, 8, &sealed, &[2, 1]).is_err());
        // And a wrong shape is an error, not garbage.
        assert!(matches!(
            open_unit(&keys, 7, &sealed, &[2, 2]),
            Err(SecureError::Length { .. })
        ));
    }

    #[test]
    fn one_client_is_an_error() {
        let ups = tables(1);
        let err = SecureExchange::default()
            .run(
                &ups,
                Granularity::Tensor,
                &ServerKeys::generate(),
                &mut ChaCha8Rng::seed_from_u64(0),
            )
            .unwrap_err();
        assert!(matches!(err, SecureError::TooFewClients(1)));
    }
}
