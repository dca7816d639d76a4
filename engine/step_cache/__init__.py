"""Step cache: DeepCache (Ma et al. 2023) for UNets. LOSSY, opt-in.

On a full step the whole UNet runs and the feature entering the up-path at the skip branch is kept; on a
cached step only the input blocks up to the branch and the output blocks from it run, on that kept feature.

  schedule   the modes (off, interval N, non-uniform N) and which steps of a run are full
  run_state  one sampling run's state: its step, the feature kept per call slot, what ran
Host-agnostic: a host runs the shallow blocks and tells the run when a sampler step ends.
May import nothing outside this package.
"""
