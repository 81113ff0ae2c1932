"""KV transfer from prefill to decode workers: decode reserves pages and publishes them, prefill
writes each layer's K/V straight into them as the layer completes (NIXL WRITE, or a same-process
copy), with deadlines, epochs and fail-closed page ownership. Entry points: `factory`
(create_sender / create_receiver) and the contract in `interface`.
"""
