//! pFedBayes' settings.

use clap::Args;
use fl_core::Strategy;
use fl_core::strategy::PFedBayes;
use fl_core::trainer::BayesStep;
use serde::{Deserialize, Serialize};

use super::{LabelCounts, Settings, defaults_from_flags, ensure};
use crate::config::RunSettings;

/// pFedBayes' settings (its `[pfedbayes]` section); the global copy's Adam step size is `--lr`.
#[derive(Debug, Clone, PartialEq, Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PFedBayesSettings {
    /// ζ, the weight of the KL term to the global posterior (applied per sample, ζ/N_i).
    #[arg(long, default_value_t = 10.0)]
    pub zeta: f64,
    /// η_p, the Adam step size of each client's personalised posterior.
    #[arg(long, default_value_t = 0.001)]
    pub personal_lr: f64,
    /// K, the personalised posterior's steps per mini-batch.
    #[arg(long, default_value_t = 5)]
    pub inner_steps: usize,
    /// The standard deviation of ε in w = μ + σ·ε: 0.001 as the authors' code (the default:
    /// it trains the CNN2 far better, README), 1 as the paper writes.
    #[arg(long, default_value_t = 0.001)]
    pub noise: f64,
    /// The initial ρ of every weight (σ = softplus(ρ); the authors: −3, σ ≈ 0.049).
    #[arg(long, default_value_t = -3.0, allow_negative_numbers = true)]
    pub rho_init: f64,
    /// β of the server's mix (1: the average of the uploads).
    #[arg(long, default_value_t = 1.0)]
    pub beta: f64,
}

defaults_from_flags!(PFedBayesSettings);

impl Settings for PFedBayesSettings {
    fn run_defaults(&self) -> toml::Table {
        // The authors' code: Adam at 0.001 for both posteriors.
        toml::toml! { lr = 0.001 }
    }

    fn strategy(&self, run: &RunSettings, _: LabelCounts<'_>) -> anyhow::Result<Box<dyn Strategy>> {
        let step = BayesStep {
            zeta: self.zeta,
            personal_lr: self.personal_lr,
            inner_steps: self.inner_steps,
            noise: self.noise,
        };
        step.validate().map_err(anyhow::Error::msg)?;
        ensure(
            self.rho_init.is_finite(),
            "--rho-init must be a finite number",
        )?;
        ensure(
            self.beta.is_finite() && self.beta > 0.0,
            "--beta must be > 0",
        )?;
        ensure(
            run.fine_tune_steps == 0,
            "pFedBayes evaluates its personalised posteriors; --fine-tune-steps does not apply",
        )?;
        Ok(Box::new(PFedBayes::new(step, self.rho_init, self.beta)))
    }
}
