"""The admin port and what a node shows of itself: the HTTP API and its OpenAPI document,
metrics, traces, KV events.
"""
