"""The worker: the device runner (`runner.py`), `jaxserve lower` (`lower.py`) and its `--compile`
(`compile_cmd.py`).

It sits above `model` and `runtime`: the runner instantiates the model (`model.decoder.CausalLM`)
with its config and lays it out with model's sharding rules (`model/sharding.py`), and runs it with
runtime's ops, mesh, KV sizing and sampler. `model` uses `runtime` (ops, routers, weight formats)
and neither imports the worker, so the three form no import cycle.
"""
