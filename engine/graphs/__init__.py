"""Graphs: CUDA-graph replay of a model's step, exact or not at all.

  step_graphs   StepGraphs: per model, keys -> probe -> capture -> replay, and the eager path otherwise
  keys, tokens  what a call's arguments contribute to a graph key (structure, identity, content)
  fingerprint   the weights and module tree a graph was captured with
  probe         whether a capture could reproduce a step (host reads, Python state, random draws)
  effects       what a step's patches store in their modules, stored again after each replay
  host_reads    reads of tensor values on the host inside a step
  rng           the generators a step may draw from
  capture       capturing so that a failure leaves torch's state intact
  eager         warm-up calls (compiling kernels ahead) and the faster eager path of a refused call
  graphed_forward  a module's whole forward replayed from graphs (ControlNets, the VAE's decoder and encoder)
  graph_memory  the driver's memory for graphs under cudaMallocAsync, and giving back what no graph uses
May import kernels/ and engine modules outside graphs (kernel_report, stock_path, patching); never a host.
Import the submodules; this package imports nothing itself (engine modules import fingerprint early).
"""
