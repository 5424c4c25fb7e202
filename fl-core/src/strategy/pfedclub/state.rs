//! pFedClub's checkpoint: every client's model, the distinct uploaded models its teachers are
//! made of, the teachers' stitching layers, and the per-client bookkeeping.
//!
//! Slots: `0..n` the clients' models, then one per distinct teacher source (a client's upload
//! of some round), then one stitch set per teacher; `extra` holds [`SavedState`].

use std::sync::Arc;

use burn::module::Module;
use rand_chacha::ChaCha8Rng;

use super::stitch::{self, Stitches, Teacher, stitch_shapes};
use super::{Assigned, PFedClub};
use crate::layers::ParamTable;
use crate::model::BlockForward;
use crate::strategy::{StrategyError, StrategyState};

/// The loop's state between rounds, as saved in a checkpoint (tables separately).
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub(super) struct SavedState {
    rounds_trained: Vec<usize>,
    phis: Vec<Vec<f64>>,
    accuracy: Vec<Option<(f64, f64)>>,
    /// The distinct teacher source models, as (round, client) of their upload.
    sources: Vec<(usize, usize)>,
    /// Which copy of each source (pFedHR tunes one per candidate; 0: the upload itself).
    #[serde(default)]
    copies: Vec<usize>,
    /// Per client: indices into `sources` and the parts of its teacher, if any.
    teachers: Vec<Option<(Vec<usize>, Vec<super::cmsr::BlockRef>)>>,
    /// Whether the server's own model (FedGH's header, HeteroFL's global model) follows, last.
    #[serde(default)]
    server: bool,
    /// The clients whose second kept model (FCCL's intra-domain teacher) follows, in order.
    #[serde(default)]
    kept: Vec<usize>,
}

fn parse(extra: &serde_json::Value) -> Result<SavedState, StrategyError> {
    serde_json::from_value(extra.clone())
        .map_err(|e| StrategyError::Restore(format!("pFedClub state: {e}")))
}

impl<M: BlockForward> PFedClub<'_, M> {
    /// The clients' models, their teachers and the bookkeeping.
    pub(super) fn save_state(&self) -> StrategyState {
        let mut state = SavedState {
            rounds_trained: self.rounds_trained.clone(),
            phis: self.phis.clone(),
            accuracy: self.accuracy.clone(),
            ..SavedState::default()
        };
        let mut slots: Vec<ParamTable> = self.tables.clone();
        let mut source_tables = Vec::new();
        let mut stitch_tables = Vec::new();
        for t in &self.teachers {
            let Some(t) = t else {
                state.teachers.push(None);
                continue;
            };
            let mut indices = Vec::new();
            for (model, &client) in t.teacher.models.iter().zip(&t.sources) {
                let key = (t.round, client);
                let same =
                    |(i, s): (usize, &(usize, usize))| *s == key && state.copies[i] == t.copy;
                let i = match state.sources.iter().enumerate().position(same) {
                    Some(i) => i,
                    None => {
                        state.sources.push(key);
                        state.copies.push(t.copy);
                        source_tables.push(ParamTable::from_module(model));
                        state.sources.len() - 1
                    }
                };
                indices.push(i);
            }
            stitch_tables.push(ParamTable::from_module(&t.teacher.stitches));
            state
                .teachers
                .push(Some((indices, t.teacher.parts.clone())));
        }
        slots.extend(source_tables);
        slots.extend(stitch_tables);
        if let Some(server) = &self.server {
            slots.push(server.clone());
            state.server = true;
        }
        for (&c, table) in &self.kept {
            slots.push(table.clone());
            state.kept.push(c);
        }
        StrategyState {
            tables: slots,
            extra: serde_json::to_value(&state).expect("state serialises"),
        }
    }

    /// The stitching layers' shapes of the `t`-th saved teacher.
    fn saved_stitch_shapes(
        &self,
        state: &SavedState,
        t: usize,
    ) -> Vec<Option<(Vec<usize>, Vec<usize>)>> {
        let (indices, parts) = state.teachers.iter().flatten().nth(t).expect("teacher");
        let source_specs: Vec<_> = indices
            .iter()
            .map(|&i| self.specs[state.sources[i].1].clone())
            .collect();
        let data = self.public.data;
        stitch_shapes(
            parts,
            &source_specs,
            &data.image_shape(),
            data.num_classes(),
        )
    }

    /// The layout of checkpoint slot `slot`.
    pub(super) fn slot_layout(
        &self,
        slot: usize,
        extra: &serde_json::Value,
    ) -> Result<ParamTable, StrategyError> {
        let n = self.tables.len();
        if slot < n {
            return Ok(self.tables[slot].clone());
        }
        let state = parse(extra)?;
        let s = slot - n;
        if let Some(&(_, client)) = state.sources.get(s) {
            return Ok(ParamTable::from_module(&(self.build)(client)));
        }
        let teachers = state.teachers.iter().flatten().count();
        let before_kept = state.sources.len() + teachers + usize::from(state.server);
        if let Some(&client) = s.checked_sub(before_kept).and_then(|k| state.kept.get(k)) {
            return Ok(self.tables[client].clone());
        }
        if state.server && s == state.sources.len() + teachers {
            return self.server.clone().ok_or_else(|| {
                StrategyError::Restore("the checkpoint holds a server model, this run none".into())
            });
        }
        let shapes = self.saved_stitch_shapes(&state, s - state.sources.len());
        let mut rng: ChaCha8Rng = rand::SeedableRng::seed_from_u64(0);
        let device = self.tables[0].device();
        Ok(ParamTable::from_module(&Stitches::new(
            &shapes, &mut rng, &device,
        )))
    }

    /// Takes back what [`save_state`](Self::save_state) wrote.
    pub(super) fn restore_state(&mut self, saved: StrategyState) -> Result<(), StrategyError> {
        let n = self.tables.len();
        let state = parse(&saved.extra)?;
        let missing = || StrategyError::Restore("pFedClub checkpoint lacks tables".into());
        let mut slots = saved.tables.into_iter();
        for c in 0..n {
            self.tables[c] = slots.next().ok_or_else(missing)?;
        }
        let sources: Vec<M> = state
            .sources
            .iter()
            .map(|&(_, client)| {
                let table = slots.next().ok_or_else(missing)?;
                Ok(table.load_into((self.build)(client))?.valid())
            })
            .collect::<Result<_, StrategyError>>()?;
        let device = self.tables[0].device();
        let mut rng: ChaCha8Rng = rand::SeedableRng::seed_from_u64(0);
        let mut t = 0;
        for (client, saved) in state.teachers.iter().enumerate() {
            let Some((indices, parts)) = saved else {
                continue;
            };
            let shapes = self.saved_stitch_shapes(&state, t);
            t += 1;
            let stitches = slots
                .next()
                .ok_or_else(missing)?
                .load_into(Stitches::new(&shapes, &mut rng, &device))?
                .valid();
            let size: usize = parts
                .iter()
                .map(|p| self.block_params[state.sources[indices[p.model]].1][p.block])
                .sum::<usize>()
                + shapes
                    .iter()
                    .flatten()
                    .map(|(a, b)| stitch::Stitch::num_params(a, b))
                    .sum::<usize>();
            self.teachers[client] = Some(Assigned {
                teacher: Arc::new(Teacher {
                    models: indices.iter().map(|&i| sources[i].clone()).collect(),
                    parts: parts.clone(),
                    stitches,
                    weight: self.club.distill_weight,
                }),
                bytes: 4 * size,
                round: state.sources[indices[0]].0,
                sources: indices.iter().map(|&i| state.sources[i].1).collect(),
                copy: state.copies.get(indices[0]).copied().unwrap_or(0),
            });
        }
        if state.server {
            self.server = Some(slots.next().ok_or_else(missing)?);
        }
        self.kept.clear();
        for &c in &state.kept {
            self.kept.insert(c, slots.next().ok_or_else(missing)?);
        }
        self.rounds_trained = state.rounds_trained;
        self.phis = state.phis;
        self.accuracy = state.accuracy;
        Ok(())
    }
}
