//! Steps 1–5 of pFedClub's server update: block grouping by CKA, controllable search,
//! stitching and matching (see the module's documentation).

use std::sync::Arc;
use std::time::Instant;

use burn::module::Module;
use burn::tensor::Tensor;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use super::cmsr::{self, BlockGroups, BlockRef};
use super::grouping::{BlockGrams, centred_gram, kmeans, similarity_matrix};
use super::stitch::{self, Stitches, Teacher, fit_stitches, mean_cosine, stitch_shapes};
use super::{Assigned, Matched, PFedClub};
use crate::model::BlockForward;
use crate::rng::{Purpose, rng_for};
use crate::strategy::StrategyError;
use crate::trainer::make_batch;

impl<M: BlockForward> PFedClub<'_, M> {
    /// Steps 1–5 of the server update for the round's uploaded models (in `clients` order);
    /// `server_rng` is the round's server generator (K-means).
    pub(super) fn reassemble(
        &self,
        round: usize,
        clients: &[usize],
        server_rng: &mut ChaCha8Rng,
    ) -> Result<(Vec<Matched<M>>, [f64; 2]), StrategyError> {
        let timer = Instant::now();
        let (club, tables, specs) = (&self.club, &self.tables, &self.specs);
        let (block_params, params) = (&self.block_params, &self.params);
        let (data, norm, public) = (
            self.public.data,
            self.public.normalization,
            self.public.samples,
        );
        // The uploaded models, frozen on the training device (for stitching) and for inference.
        let frozen: Vec<M> = clients
            .iter()
            .map(|&c| Ok(tables[c].load_into((self.build)(c))?.freeze()))
            .collect::<Result<_, StrategyError>>()?;
        let inference: Vec<M> = frozen.iter().map(Module::valid).collect();
        let round_specs: Vec<Vec<_>> = clients.iter().map(|&c| specs[c].clone()).collect();
        let round_block_params: Vec<&Vec<usize>> =
            clients.iter().map(|&c| &block_params[c]).collect();
        let base = inference[0].devices().into_iter().next().expect("a device");

        // Functional grouping: CKA of block inputs and outputs on a public batch.
        let probe = &public[..club.cka_samples.min(public.len())];
        let (images, _) = make_batch(data, norm, probe, &base);
        let grams: Vec<Vec<BlockGrams>> = inference
            .par_iter()
            .map(|m| {
                let outputs = m.forward_all_blocks(images.clone());
                let mut input = centred_gram(images.clone().flatten::<2>(1, 3));
                outputs
                    .into_iter()
                    .map(|o| {
                        let output = centred_gram(o.pooled());
                        let g = BlockGrams {
                            input: std::mem::take(&mut input),
                            output: output.clone(),
                        };
                        input = output;
                        g
                    })
                    .collect()
            })
            .collect();
        let features = timer.elapsed().as_secs_f64();
        let timer = Instant::now();
        let index: Vec<BlockRef> = grams
            .iter()
            .enumerate()
            .flat_map(|(model, g)| (0..g.len()).map(move |block| BlockRef { model, block }))
            .collect();
        let flat: Vec<BlockGrams> = grams.into_iter().flatten().collect();
        let sim = similarity_matrix(&flat);
        let assignment = kmeans(&sim, club.groups, server_rng);
        let mut group_of: Vec<Vec<usize>> = round_specs.iter().map(|s| vec![0; s.len()]).collect();
        for (b, g) in index.iter().zip(&assignment) {
            group_of[b.model][b.block] = *g;
        }
        let groups = BlockGroups { group_of };
        let grouping = timer.elapsed().as_secs_f64();
        let position = |b: BlockRef| index.iter().position(|&x| x == b).expect("known block");
        let similarity = |a: BlockRef, b: BlockRef| sim[position(a)][position(b)];

        let input_shape = data.image_shape().to_vec();
        let classes = data.num_classes();
        let size_of = |parts: &[BlockRef]| -> usize {
            let blocks: usize = parts
                .iter()
                .map(|p| round_block_params[p.model][p.block])
                .sum();
            let stitches: usize = stitch_shapes(parts, &round_specs, &input_shape, classes)
                .iter()
                .flatten()
                .map(|(from, to)| stitch::Stitch::num_params(from, to))
                .sum();
            blocks + stitches
        };
        // Matching compares logits on the public samples, batch by batch.
        let match_batches: Vec<Tensor<4>> = public
            .chunks(self.batch_size.max(1))
            .map(|b| make_batch(data, norm, b, &base).0)
            .collect();
        let score = |candidate: &dyn Fn(Tensor<4>) -> Tensor<2>, own: &[Tensor<2>]| {
            agreement(&match_batches, own, candidate)
        };

        // Candidates, stitching and matching for each uploaded model, in parallel.
        let matched = (0..clients.len())
            .into_par_iter()
            .map(|own| -> Result<Matched<M>, StrategyError> {
                let client = clients[own];
                let mut rng: ChaCha8Rng =
                    rng_for(self.seed, Purpose::Server, round as u64, 1 + client as u64);
                let own_size = params[client] as f64;
                let keep = |parts: &[BlockRef]| match club.size_limit {
                    Some(eta) => size_of(parts) as f64 <= (1.0 + eta) * own_size,
                    None => true,
                };
                let timer = Instant::now();
                let cmsr::Candidates { found, valid } = cmsr::candidates(
                    own,
                    &groups,
                    &similarity,
                    club.rules,
                    club.candidates,
                    &keep,
                    &mut rng,
                );
                let mut seconds = [timer.elapsed().as_secs_f64(), 0.0, 0.0];
                let mut timer = Instant::now();
                let own_logits: Vec<Tensor<2>> = match_batches
                    .iter()
                    .map(|images| inference[own].infer(images.clone()))
                    .collect();
                let mut best: Option<(f64, Vec<BlockRef>, Stitches)> = None;
                for parts in &found {
                    // The own logits, then each candidate's score, count as matching.
                    seconds[2] += timer.elapsed().as_secs_f64();
                    timer = Instant::now();
                    let shapes = stitch_shapes(parts, &round_specs, &input_shape, classes);
                    let train_device = frozen[own].devices().into_iter().next().expect("a device");
                    let stitches = Stitches::new(&shapes, &mut rng, &train_device);
                    let stitches = fit_stitches(
                        &frozen,
                        parts,
                        stitches,
                        data,
                        norm,
                        public,
                        &club.stitch,
                        &mut rng,
                    )
                    .valid();
                    seconds[1] += timer.elapsed().as_secs_f64();
                    timer = Instant::now();
                    let run =
                        |images| stitch::infer_candidate(&inference, parts, &stitches, images);
                    let score = score(&run, &own_logits);
                    if best.as_ref().is_none_or(|(s, _, _)| score > *s) {
                        best = Some((score, parts.clone(), stitches));
                    }
                }
                seconds[2] += timer.elapsed().as_secs_f64();
                let Some((_, parts, stitches)) = best else {
                    return Ok(Matched {
                        teacher: None,
                        phi: None,
                        candidates: 0,
                        valid,
                        seconds,
                    });
                };
                let size = size_of(&parts);
                let (used, parts) = used_models(&parts);
                let teacher = Teacher {
                    models: used.iter().map(|&u| inference[u].clone()).collect(),
                    parts,
                    stitches,
                    weight: club.distill_weight,
                };
                Ok(Matched {
                    teacher: Some(Assigned {
                        teacher: Arc::new(teacher),
                        bytes: 4 * size,
                        round,
                        sources: used.iter().map(|&u| clients[u]).collect(),
                        copy: 0,
                    }),
                    phi: Some((size as f64 - own_size) / own_size),
                    candidates: found.len(),
                    valid,
                    seconds,
                })
            })
            .collect::<Result<_, _>>()?;
        Ok((matched, [features, grouping]))
    }
}

/// The models a candidate's blocks come from (sorted), and its parts indexing into them: a
/// teacher keeps only those.
pub(super) fn used_models(parts: &[BlockRef]) -> (Vec<usize>, Vec<BlockRef>) {
    let mut used: Vec<usize> = parts.iter().map(|p| p.model).collect();
    used.sort_unstable();
    used.dedup();
    let parts = parts
        .iter()
        .map(|p| BlockRef {
            model: used.iter().position(|&u| u == p.model).expect("used"),
            block: p.block,
        })
        .collect();
    (used, parts)
}

/// The mean over the public samples (in `batches`) of the cosine between a candidate's logits
/// and the client model's (`own`, per batch): how well a candidate matches a client.
pub(super) fn agreement(
    batches: &[Tensor<4>],
    own: &[Tensor<2>],
    candidate: &dyn Fn(Tensor<4>) -> Tensor<2>,
) -> f64 {
    let (mut total, mut rows) = (0.0, 0.0);
    for (images, own) in batches.iter().zip(own) {
        let n = images.dims()[0] as f64;
        total += n * mean_cosine(candidate(images.clone()), own.clone());
        rows += n;
    }
    total / rows
}
