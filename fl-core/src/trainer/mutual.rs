//! Deep mutual learning (Zhang et al., CVPR 2018) of two models on one client's data: the
//! received model and the client's own, each on cross-entropy plus KL(other ‖ itself) towards
//! the other's (detached) predictions, both stepped on every mini-batch. FedKEMF's knowledge
//! extraction: the shared knowledge network learns from the personal model and back.

use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn::tensor::activation::{log_softmax, softmax};
use rand::seq::SliceRandom;

use super::{
    LocalTask, LocalUpdate, TrainConfig, TrainError, epoch_sum, local_optimizer, make_batch,
    model_device,
};
use crate::layers::ParamTable;
use crate::model::Classifier;
use crate::rng::{Purpose, rng_for};

/// KL(p_target ‖ p_model) of two logit batches, averaged over the batch; `target` carries no
/// gradient.
fn kl_towards(target: Tensor<2>, model: Tensor<2>) -> Tensor<1> {
    let target = target.detach();
    let p = softmax(target.clone(), 1);
    (p * (log_softmax(target, 1) - log_softmax(model, 1)))
        .sum_dim(1)
        .mean()
}

/// Trains the received model (`task.start`) and the client's own (`task.state`, of
/// `task.personal_template`'s architecture) together; the upload is the received model, the
/// state the client's own. `train_loss` is the client's own model's loss.
pub(super) fn train<M: Classifier>(
    task: LocalTask<'_, M>,
    cfg: &TrainConfig,
) -> Result<LocalUpdate, TrainError> {
    let missing = |what: &str| TrainError::Public(format!("mutual learning needs {what}"));
    let own_table = task
        .state
        .ok_or_else(|| missing("the client's own model"))?;
    let own_template = task
        .personal_template
        .ok_or_else(|| missing("the client's own architecture"))?;
    let mut shared = task.start.load_into(task.template)?;
    let mut own = own_table.load_into(own_template)?;
    let device = model_device(&shared);
    let (mut shared_optim, mut own_optim) = (local_optimizer(cfg), local_optimizer(cfg));
    let ce = CrossEntropyLossConfig::new().init(&device);
    let mut rng = rng_for(
        task.seed,
        Purpose::Shuffle,
        task.round as u64,
        task.client as u64,
    );
    let mut order = task.indices.to_vec();
    let (mut loss_sum, mut steps) = (0.0, 0);
    for epoch in 1..=cfg.local_epochs {
        order.shuffle(&mut rng);
        let mut losses = Vec::new();
        for batch in order.chunks(cfg.batch_size) {
            let (images, labels) = make_batch(task.data, task.norm, batch, &device);
            let shared_logits = shared.forward(images.clone());
            let own_logits = own.forward(images);
            let shared_loss = ce.forward(shared_logits.clone(), labels.clone())
                + kl_towards(own_logits.clone(), shared_logits.clone());
            let own_loss =
                ce.forward(own_logits.clone(), labels) + kl_towards(shared_logits, own_logits);
            let grads = GradientsParams::from_grads(shared_loss.backward(), &shared);
            shared = shared_optim.step(cfg.lr, shared, grads);
            let grads = GradientsParams::from_grads(own_loss.backward(), &own);
            own = own_optim.step(cfg.lr, own, grads);
            losses.push(own_loss.detach());
        }
        let (sum, n) = epoch_sum(losses, task.client, epoch)?;
        loss_sum += sum;
        steps += n;
    }
    Ok(LocalUpdate {
        client: task.client,
        table: ParamTable::from_module(&shared),
        state: Some(ParamTable::from_module(&own)),
        prototypes: None,
        num_samples: task.indices.len(),
        train_loss: loss_sum / steps as f64,
        steps,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_model::{flat, synthetic_data, tracked};
    use crate::trainer::{LocalOptimizer, LocalProcedure, train_local};
    use burn::module::Module;

    fn predictions_gap(
        a: &ParamTable,
        b: &ParamTable,
        data: &fl_data::Dataset,
        norm: &fl_data::Normalization,
    ) -> f32 {
        let idx: Vec<usize> = (0..60).collect();
        let run = |t: &ParamTable| {
            let m = t.load_into(tracked(0)).unwrap().valid();
            let (x, _) = make_batch(data, norm, &idx, &model_device(&m));
            softmax(m.forward(x), 1)
        };
        (run(a) - run(b)).abs().mean().into_scalar::<f32>()
    }

    #[test]
    fn mutual_learning_trains_both_models_towards_each_other() {
        let (data, norm) = synthetic_data(120, 3);
        let indices: Vec<usize> = (0..60).collect();
        let (shared, own) = (
            ParamTable::from_module(&tracked(1)),
            ParamTable::from_module(&tracked(2)),
        );
        let cfg = TrainConfig {
            local_epochs: 3,
            batch_size: 10,
            lr: 1e-3,
            optimizer: LocalOptimizer::Adam,
            procedure: LocalProcedure::Mutual,
            ..TrainConfig::default()
        };
        let task = |state: Option<ParamTable>| LocalTask {
            template: tracked(0),
            start: shared.clone(),
            data: &data,
            norm: &norm,
            indices: &indices,
            client: 1,
            round: 2,
            seed: 4,
            objective: None,
            state,
            personal_template: Some(tracked(0)),
        };
        let up = train_local(task(Some(own.clone())), &cfg).unwrap();
        let trained_own = up.state.clone().unwrap();
        assert_ne!(flat(&up.table), flat(&shared));
        assert_ne!(flat(&trained_own), flat(&own));
        // The two models agree more after learning from each other.
        let before = predictions_gap(&shared, &own, &data, &norm);
        let after = predictions_gap(&up.table, &trained_own, &data, &norm);
        assert!(after < before, "{before} -> {after}");
        // Deterministic; and without the client's own model it is a clear error.
        let again = train_local(task(Some(own.clone())), &cfg).unwrap();
        assert_eq!(flat(&again.table), flat(&up.table));
        assert!(matches!(
            train_local(task(None), &cfg),
            Err(TrainError::Public(_))
        ));
    }
}
