//! Tests of the parameter table: extraction, loading, arithmetic, recombination, similarity.

use super::*;
use crate::model::Classifier;
use crate::test_model::{TinyNet, device, tiny};
use burn::tensor::Distribution;
use proptest::prelude::*;
use rand::SeedableRng;

fn table(seed: u64) -> ParamTable {
    let m = tiny(seed);
    ParamTable::from_module_with_blocks(&m, m.blocks()).unwrap()
}

fn host(t: &ParamTable) -> Vec<Vec<f32>> {
    t.to_host().unwrap()
}

fn close(a: &[Vec<f32>], b: &[Vec<f32>], tol: f32) -> bool {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .all(|(x, y)| (x - y).abs() <= tol)
}

#[test]
fn paper_layers_keep_batch_norm_with_its_convolution_and_segments_follow_the_paper() {
    let t = table(1);
    // conv, bn, fc1, fc2: the BatchNorm (tensors 2-5) joins the convolution's layer.
    assert_eq!(
        t.units(Granularity::Layer).unwrap(),
        [vec![0, 1, 2, 3, 4, 5], vec![6, 7], vec![8, 9]]
    );
    use super::recombine::segment_of;
    let segments = |n: usize, x: f64| (1..=n).map(|j| segment_of(j, n, x)).collect::<Vec<_>>();
    assert_eq!(segments(5, 0.2), [1, 2, 3, 4, 5]);
    assert_eq!(segments(5, 0.5), [1, 1, 2, 2, 2]);
    assert_eq!(segments(7, 0.3), [1, 1, 2, 2, 3, 3, 4]);
    assert_eq!(segments(5, 1.0), [1; 5]);
    // Over the tiny net's three paper layers, x = 0.5 gives ⌈j/1.5⌉ = 1, 2, 2.
    assert_eq!(
        t.units(Granularity::Segments { fraction: 0.5 }).unwrap(),
        [vec![0, 1, 2, 3, 4, 5], vec![6, 7, 8, 9]]
    );
}

#[test]
fn layout_names_layers_and_kinds() {
    let t = table(1);
    let names: Vec<&str> = t
        .layout()
        .tensors()
        .iter()
        .map(|i| i.name.as_str())
        .collect();
    assert_eq!(
        names,
        [
            "conv.weight",
            "conv.bias",
            "bn.gamma",
            "bn.beta",
            "bn.running_mean",
            "bn.running_var",
            "fc1.weight",
            "fc1.bias",
            "fc2.weight",
            "fc2.bias"
        ]
    );
    let layers: Vec<&str> = t
        .layout()
        .layers()
        .iter()
        .map(|(n, _)| n.as_str())
        .collect();
    assert_eq!(layers, ["conv", "bn", "fc1", "fc2"]);
    let buffers = t
        .layout()
        .tensors()
        .iter()
        .filter(|i| i.kind == ParamKind::Buffer)
        .count();
    assert_eq!(buffers, 2);
    assert_eq!(t.num_elements(), tiny(1).num_params());
    assert_eq!(t.byte_size(), 4 * t.num_elements());
    assert_eq!(t.layout().blocks().len(), 3);
}

#[test]
fn extract_load_round_trip_is_exact() {
    let source = table(1);
    let target = tiny(2);
    let loaded = source.load_into(target).unwrap();
    assert_eq!(host(&ParamTable::from_module(&loaded)), host(&source));
}

#[test]
fn load_keeps_param_ids_and_autodiff() {
    let d = device().autodiff();
    d.seed(3);
    let target = TinyNet::new(&d);
    let ids: Vec<_> = collect_ids(&target);
    let loaded = table(1).load_into(target).unwrap();
    assert_eq!(collect_ids(&loaded), ids);
    // Still trainable: a gradient reaches the first layer.
    let x = Tensor::<4>::random([2, 1, 8, 8], Distribution::Default, &d);
    let grads = loaded.forward(x).sum().backward();
    assert!(
        loaded.conv.weight.val().grad(&grads).is_some(),
        "loaded model lost autodiff"
    );
}

#[test]
fn load_keeps_the_gradient_checkpointing_strategy() {
    let d = device().autodiff().gradient_checkpointing();
    d.seed(3);
    let loaded = table(1).load_into(TinyNet::new(&d)).unwrap();
    let strategy = loaded.conv.weight.val().gradient_checkpointing_strategy();
    assert_eq!(strategy, Some(GradientCheckpointingStrategy::Balanced));
    // Inputs made on the model's device mix with its parameters (Burn panics on a mix).
    let x = Tensor::<4>::random([2, 1, 8, 8], Distribution::Default, &loaded.devices()[0]);
    let grads = loaded.forward(x).sum().backward();
    assert!(loaded.conv.weight.val().grad(&grads).is_some());
    let plain = table(1)
        .load_into(TinyNet::new(&device().autodiff()))
        .unwrap();
    let strategy = plain.conv.weight.val().gradient_checkpointing_strategy();
    assert_eq!(strategy, Some(GradientCheckpointingStrategy::Disabled));
}

fn collect_ids<M: Module>(m: &M) -> Vec<burn::module::ParamId> {
    struct Ids(Vec<burn::module::ParamId>);
    impl ModuleVisitor for Ids {
        fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<D>>) {
            self.0.push(p.id);
        }
    }
    let mut ids = Ids(Vec::new());
    m.visit(&mut ids);
    ids.0
}

#[test]
fn loading_into_a_clone_does_not_touch_the_original_batchnorm() {
    let original = tiny(1);
    let before = host(&ParamTable::from_module(&original));
    // Burn's clone shares running statistics; load_into must detach first.
    let _other = table(2).load_into(original.clone()).unwrap();
    assert_eq!(host(&ParamTable::from_module(&original)), before);
}

#[test]
fn extraction_sees_the_latest_running_statistics() {
    let d = device().autodiff();
    d.seed(4);
    let model = TinyNet::new(&d);
    let x = Tensor::<4>::random([8, 1, 8, 8], Distribution::Normal(3.0, 1.0), &d);
    let _ = model.forward(x);
    // One forward pass in training mode moves the running mean away from 0.
    let t = ParamTable::from_module(&model);
    let mean = &host(&t)[4];
    assert!(
        mean.iter().any(|v| v.abs() > 1e-3),
        "running mean is stale: {mean:?}"
    );
}

#[test]
fn average_mix_and_similarity() {
    let (a, b) = (table(1), table(2));
    let avg = ParamTable::average(&[a.clone(), b.clone()], Some(&[1.0, 3.0])).unwrap();
    let expect: Vec<Vec<f32>> = host(&a)
        .iter()
        .zip(host(&b))
        .map(|(x, y)| x.iter().zip(&y).map(|(x, y)| 0.25 * x + 0.75 * y).collect())
        .collect();
    assert!(close(&host(&avg), &expect, 1e-6));
    let mixed = a.mix(&b, 0.25).unwrap();
    assert!(close(&host(&mixed), &expect, 1e-6));
    assert!((a.cosine_similarity(&a).unwrap() - 1.0).abs() < 1e-6);
    assert!(a.l2_distance(&a).unwrap() < 1e-3);
    assert!(a.l2_distance(&b).unwrap() > 0.1);
    assert_eq!(a.layer_cosine_similarity(&b).unwrap().len(), 4);
    // The Gram matrix agrees with the pairwise products.
    let c = table(3);
    let g = ParamTable::gram(&[a.clone(), b.clone(), c.clone()]).unwrap();
    for (i, x) in [&a, &b, &c].into_iter().enumerate() {
        for (j, y) in [&a, &b, &c].into_iter().enumerate() {
            let [dot, xx, _] = sum_products(&x.layer_products(y).unwrap());
            assert!((g[i][j] - dot).abs() <= 1e-6 * xx.max(1.0), "{i} {j}");
        }
    }
    assert!(ParamTable::gram(&[]).unwrap().is_empty());
    assert!(ParamTable::average(std::slice::from_ref(&a), Some(&[0.0])).is_err());
    assert!(ParamTable::average(&[], None).is_err());
}

#[test]
fn different_architectures_are_rejected() {
    let other = ParamTable::from_module(&burn::nn::LinearConfig::new(3, 2).init(&device()));
    assert!(matches!(
        ParamTable::gram(&[table(1), other.clone()]),
        Err(LayerError::LayoutMismatch(_))
    ));
    assert!(matches!(
        table(1).mix(&other, 0.5),
        Err(LayerError::LayoutMismatch(_))
    ));
    assert!(other.load_into(tiny(1)).is_err());
}

#[test]
fn bad_block_declarations_are_rejected() {
    let m = tiny(1);
    let mut blocks = m.blocks();
    blocks.pop();
    let e = ParamTable::from_module_with_blocks(&m, blocks).unwrap_err();
    assert!(
        e.to_string().contains("fc2.weight' belongs to no block"),
        "{e}"
    );
    let mut blocks = m.blocks();
    blocks[1].modules.push("conv".into());
    assert!(ParamTable::from_module_with_blocks(&m, blocks).is_err());
}

fn granularities() -> Vec<Granularity> {
    vec![
        Granularity::Tensor,
        Granularity::Layer,
        Granularity::Block,
        Granularity::Segments { fraction: 0.5 },
        Granularity::Segments { fraction: 0.3 },
        Granularity::Segments { fraction: 1.0 },
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(12))]
    /// FedMR Lemma 4.4: recombination uses every source unit exactly once, so the sum (and
    /// average) of all models is unchanged.
    #[test]
    fn recombination_preserves_every_unit_and_the_sum(k in 2usize..6, seed: u64, g in 0usize..6) {
        let g = granularities()[g];
        let models: Vec<ParamTable> = (0..k).map(|i| table(seed.wrapping_add(i as u64))).collect();
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let r = recombine(&models, g, &mut rng).unwrap();
        let units = models[0].units(g).unwrap();
        prop_assert_eq!(r.sources.len(), units.len());
        let src: Vec<_> = models.iter().map(host).collect();
        let new: Vec<_> = r.models.iter().map(host).collect();
        for (unit, perm) in units.iter().zip(&r.sources) {
            let mut sorted = perm.clone();
            sorted.sort_unstable();
            prop_assert_eq!(sorted, (0..k).collect::<Vec<_>>());
            for (j, &old) in perm.iter().enumerate() {
                for &t in unit {
                    prop_assert_eq!(&new[j][t], &src[old][t]);
                }
            }
        }
        let before = ParamTable::average(&models, None).unwrap();
        let after = ParamTable::average(&r.models, None).unwrap();
        prop_assert!(close(&host(&before), &host(&after), 1e-5));
    }
}

#[test]
fn whole_model_segments_are_a_permutation_of_models() {
    let models: Vec<ParamTable> = (0..4).map(table).collect();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let r = recombine(&models, Granularity::Segments { fraction: 1.0 }, &mut rng).unwrap();
    assert_eq!(r.sources.len(), 1);
    for (j, &old) in r.sources[0].iter().enumerate() {
        assert_eq!(host(&r.models[j]), host(&models[old]));
    }
    assert!(
        models[0]
            .units(Granularity::Segments { fraction: 0.0 })
            .is_err()
    );
    let no_blocks = ParamTable::from_module(&tiny(1));
    assert!(no_blocks.units(Granularity::Block).is_err());
}
