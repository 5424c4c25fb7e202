//! The run's final model file (`model.bpk`): Burn's burnpack record of the module, with every
//! tensor's parameter id numbered 0, 1, 2, … in the order Burn visits the module.
//!
//! Burn draws a random [`ParamId`](burn::module::ParamId) for every parameter and running
//! statistic, and the record stores them, so two runs of the same seed would write different
//! bytes. A [`ModuleMapper`](burn::module::ModuleMapper) can renumber parameters but not a
//! BatchNorm's running statistics (`RunningState::map` keeps its own id), so the ids are
//! rewritten in the record itself, by tensor path.

use std::collections::HashMap;
use std::path::Path;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{Bool, Int, Tensor};

/// Writes `model` to `path` as a burnpack record whose parameter ids are the tensors' visiting
/// order (parameters and running statistics alike), so the same weights give the same bytes.
pub(crate) fn save_model<M: Module>(model: M, path: &Path) -> Result<(), String> {
    let mut order = VisitOrder::default();
    model.visit(&mut order);
    let bytes = model
        .into_record()
        .into_bytes()
        .map_err(|e| format!("{e:?}"))?;
    let mut tensors = burn_pack::Reader::from_bytes(bytes)
        .and_then(burn_pack::Reader::into_tensors)
        .map_err(|e| e.to_string())?;
    for t in &mut tensors {
        let id = *order
            .ids
            .get(&t.name)
            .ok_or_else(|| format!("the record has a tensor `{}` the module lacks", t.name))?;
        t.param_id = Some(id);
    }
    // In visiting order, as Burn's own save writes them.
    tensors.sort_by_key(|t| t.param_id);
    burn_pack::Writer::new(tensors)
        .auto_extension(false)
        .write_to_file(path)
        .map_err(|e| e.to_string())
}

/// Each tensor's path (as Burn's record names it) and its index in visiting order.
#[derive(Default)]
struct VisitOrder {
    path: Vec<String>,
    ids: HashMap<String, u64>,
}

impl VisitOrder {
    fn record(&mut self) {
        let id = self.ids.len() as u64;
        self.ids.insert(self.path.join("."), id);
    }
}

impl ModuleVisitor for VisitOrder {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, _: &Param<Tensor<D>>) {
        self.record();
    }

    fn visit_int<const D: usize>(&mut self, _: &Param<Tensor<D, Int>>) {
        self.record();
    }

    fn visit_bool<const D: usize>(&mut self, _: &Param<Tensor<D, Bool>>) {
        self.record();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
    use burn::tensor::Device;

    #[derive(Module, Debug)]
    struct Net {
        fc: Linear,
        norm: BatchNorm,
    }

    fn net(device: &Device) -> Net {
        Net {
            fc: LinearConfig::new(3, 4).init(device),
            norm: BatchNormConfig::new(4).init(device),
        }
    }

    #[test]
    fn the_same_weights_give_the_same_bytes_running_statistics_included() {
        let device = Device::default();
        let a = net(&device);
        // The same weights in a module built again: fresh random ids everywhere.
        let b = net(&device).load_record(a.clone().into_record());
        let dir = tempfile::tempdir().unwrap();
        let (pa, pb) = (dir.path().join("a.bpk"), dir.path().join("b.bpk"));
        save_model(a.clone(), &pa).unwrap();
        save_model(b, &pb).unwrap();
        assert_eq!(std::fs::read(&pa).unwrap(), std::fs::read(&pb).unwrap());

        // Loadable, with the weights and running statistics, ids in visiting order.
        let loaded = net(&device).load_file(&pa);
        let values = |n: &Net| {
            let mut v = n.fc.weight.val().into_data().try_to_vec::<f32>().unwrap();
            v.extend(
                n.norm
                    .running_var
                    .value()
                    .into_data()
                    .try_to_vec::<f32>()
                    .unwrap(),
            );
            v
        };
        assert_eq!(values(&loaded), values(&a));
        let tensors = burn_pack::Reader::from_file(&pa)
            .unwrap()
            .into_tensors()
            .unwrap();
        let mut ids: Vec<_> = tensors.iter().map(|t| t.param_id).collect();
        ids.sort();
        assert_eq!(ids, (0..6).map(Some).collect::<Vec<_>>());
    }
}
