"""The OpenAPI 3 document of the admin API, served at ``GET /openapi.json``.

Every route of :func:`kvpool.server.admin.api.make_admin_app` is here (a test checks
that the two agree) and CI runs schemathesis against a real node with it.
"""

from __future__ import annotations

from typing import Any

from kvpool.placement.lookup import MAX_LOOKUP_KEYS, MAX_LOOKUP_TOKENS

__all__ = ["openapi_document"]

VERSION = "1"

_KEY = {"type": "string", "pattern": "^[0-9a-f]{32}$",
        "description": "a chunk key, 32 lowercase hex characters"}
_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["type", "message"],
    "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}}
_NODE = {"type": "object", "required": ["id", "data", "admin", "weight", "state"], "properties": {
    "id": {"type": "string"}, "data": {"type": "string"}, "admin": {"type": "string"},
    "weight": {"type": "number"}, "state": {"enum": ["up", "draining", "down"]},
    **{label: {"type": "string", "description": f"failure domain: the node's {label} (only "
               "when set; a node without host is on its data address's host)"}
       for label in ("host", "rack", "zone")}}}
_MAP = {"type": "object", "required": ["epoch", "replication", "fallbacks", "nodes"],
        "properties": {"epoch": {"type": "integer"}, "replication": {"type": "integer"},
                       "fallbacks": {"type": "integer"},
                       "nodes": {"type": "array", "items": {"$ref": "#/components/schemas/Node"}},
                       "node_id": {"type": "string"}, "source": {"type": "string"}}}
_TIER = {"enum": ["dram", "ssd", "s3"]}
_CHUNK = {"type": "object", "required": ["key", "tiers", "pinned"], "properties": {
    "key": _KEY, "tiers": {"type": "array", "items": _TIER}, "pinned": {"type": "boolean"},
    "size_bytes": {"type": ["integer", "null"]},
    "ttl_s": {"type": ["number", "null"], "description": "seconds left, null: no TTL"},
    "last_access": {"type": ["number", "null"], "description": "Unix time of the last PUT/GET"},
    "depth": {"type": ["integer", "null"], "description": "chunk index in its prefix"},
    "num_tokens": {"type": ["integer", "null"]},
    "parent": {"oneOf": [_KEY, {"type": "null"}]}}}
_NAMESPACE = {"type": "object", "required": ["model", "dtype", "num_layers", "num_kv_heads",
                                             "head_dim"],
              "properties": {"model": {"type": "string", "minLength": 1},
                             "dtype": {"type": "string"},
                             "num_layers": {"type": "integer", "minimum": 1},
                             "num_kv_heads": {"type": "integer", "minimum": 1},
                             "head_dim": {"type": "integer", "minimum": 1},
                             "chunk_tokens": {"type": "integer", "minimum": 1},
                             "tp_size": {"type": "integer", "minimum": 1},
                             "tp_rank": {"type": "integer", "minimum": 0},
                             "tenant": {"type": "string"}, "adapter": {"type": "string"},
                             "kv_format": {"enum": ["mla"]}},
              "additionalProperties": False}


def _json(schema: dict[str, Any], description: str = "") -> dict[str, Any]:
    return {"description": description or "OK",
            "content": {"application/json": {"schema": schema}}}


def _err(description: str) -> dict[str, Any]:
    return _json({"$ref": "#/components/schemas/Error"}, description)


_AUTH = {"401": _err("a token is required (tokens file or admin token) and was not given, "
                     "or is unknown"),
         "403": _err("the token's role may not do this (read < write < admin), or a "
                     "non-admin asked for scope=raw")}
_BAD = {"400": _err("bad input")}
_BIG = {"413": _err("the body is too large (64 KiB; a lookup 64 MiB)")}


def _op(summary: str, responses: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"summary": summary, "responses": responses, **extra}


def _path_param(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": schema}


def openapi_document() -> dict[str, Any]:
    # Long by design: the document itself, one literal (each path's schema), no logic.
    key_param = _path_param("key", _KEY)
    paths: dict[str, Any] = {
        "/healthz": {"get": _op("liveness", {"200": _json({
            "type": "object", "required": ["status", "node_id"],
            "properties": {"status": {"const": "ok"}, "node_id": {"type": "string"}}})})},
        "/readyz": {"get": _op("readiness: up in the cluster map and not stopping", {
            "200": _json({"$ref": "#/components/schemas/Ready"}),
            "503": _json({"$ref": "#/components/schemas/Ready"}, "not ready")})},
        "/metrics": {"get": _op("metrics in Prometheus text format", {
            "200": {"description": "OK", "content": {"text/plain": {"schema": {
                "type": "string"}}}},
            "404": _err("metrics are off (--no-metrics)")})},
        "/openapi.json": {"get": _op("this document", {"200": _json({"type": "object"})})},
        "/v1/stats": {"get": _op("the node's counters and tiers", {"200": _json({
            "type": "object", "required": ["node_id", "tiers", "requests"]})})},
        "/v1/cluster": {"get": _op("the cluster map this node serves",
                                   {"200": _json({"$ref": "#/components/schemas/ClusterMap"})})},
        "/v1/cluster/{action}": {"post": _op(
            "join, drain or remove a node (etcd clusters)",
            {"200": _json({"$ref": "#/components/schemas/ClusterMap"}, "the new map"), **_BAD,
             **_BIG, **_AUTH, "404": _err("no such action"),
             "409": _err("the map is static (a file or --peers)"),
             "503": _err("etcd unreachable")},
            parameters=[_path_param("action", {"enum": ["join", "drain", "remove"]})],
            requestBody={"required": True, "content": {"application/json": {"schema": {
                "type": "object", "required": ["id"], "additionalProperties": False,
                "properties": {"id": {"type": "string", "minLength": 1},
                               "data": {"type": "string"}, "admin": {"type": "string"},
                               "weight": {"type": "number", "exclusiveMinimum": 0},
                               "host": {"type": "string"}, "rack": {"type": "string"},
                               "zone": {"type": "string"}}}}}})},
        "/v1/lookup": {"post": _op(
            "how many leading chunks of a prompt the whole cluster holds, and their tiers",
            {"200": _json({"type": "object", "required": ["num_chunks", "tiers", "keys"],
                           "properties": {"num_chunks": {"type": "integer"},
                                          "num_tokens": {"type": "integer"},
                                          "chunk_tokens": {"type": "integer"},
                                          "tiers": {"type": "array", "items": _TIER},
                                          "keys": {"type": "array", "items": _KEY}}}),
             **_BAD, **_BIG, **_AUTH, "503": _err("peers unreachable")},
            requestBody={"required": True, "content": {"application/json": {"schema": {"oneOf": [
                {"type": "object", "required": ["keys"], "additionalProperties": False,
                 "properties": {"keys": {"type": "array", "items": _KEY,
                                         "maxItems": MAX_LOOKUP_KEYS}}},
                {"type": "object", "required": ["namespace", "tokens"],
                 "additionalProperties": False,
                 "properties": {"namespace": _NAMESPACE, "tokens": {
                     "type": "array", "maxItems": MAX_LOOKUP_TOKENS,
                     "items": {"type": "integer", "minimum": 0,
                               "maximum": 4294967295}}}}]}}}})},
        "/v1/events": {"get": _op(
            "KV events (stored, evicted, demoted, removed, expired) as server-sent events",
            {"200": {"description": "an endless text/event-stream", "content": {
                "text/event-stream": {"schema": {"type": "string"}}}}, **_BAD, **_AUTH},
            parameters=[{"name": "types", "in": "query", "required": False,
                         "schema": {"type": "string"},
                         "description": "comma-separated subset of stored,evicted,demoted,"
                                        "removed,expired"}])},
        "/v1/chunks/{key}": {
            "get": _op("what this node knows of a chunk (no data)", {
                "200": _json({"$ref": "#/components/schemas/Chunk"}), **_BAD,
                "404": _err("no tier of this node holds it")}, parameters=[key_param]),
            "delete": _op("delete a chunk from every tier of this node", {
                "200": _json({"type": "object", "required": ["key", "deleted"],
                              "properties": {"key": _KEY, "deleted": {"const": True}}}),
                **_BAD, **_AUTH, "404": _err("no tier of this node holds it")},
                parameters=[key_param])},
        "/v1/chunks/{key}/{action}": {"post": _op(
            "pin (never evict) or unpin a chunk in DRAM",
            {"200": _json({"type": "object", "required": ["key", "pinned"],
                           "properties": {"key": _KEY, "pinned": {"type": "boolean"}}}),
             **_BAD, **_AUTH, "404": _err("not in this node's DRAM tier, or no such action")},
            parameters=[key_param, _path_param("action", {"enum": ["pin", "unpin"]})])},
        "/v1/admin/evict": {"post": _op(
            "drop unpinned chunks: a whole tier (dram, ssd) or one namespace's DRAM chunks "
            "(an eviction: S3 keeps its copies)",
            {"200": _json({"type": "object", "required": ["evicted"], "properties": {
                "evicted": {"type": "object", "properties": {
                    "dram": {"type": "integer"}, "ssd": {"type": "integer"}}}}}),
             **_BAD, **_BIG, **_AUTH},
            requestBody={"required": True, "content": {"application/json": {"schema": {
                "type": "object", "additionalProperties": False, "properties": {
                    "tier": {"enum": ["dram", "ssd"]},
                    "namespace": {**_KEY, "description": "a namespace digest"}}}}}})},
        "/v1/admin/flush": {"post": _op(
            "wait until the SSD write-behind queue is empty",
            {"200": _json({"type": "object", "required": ["flushed", "pending_writes"],
                           "properties": {"flushed": {"type": "boolean"},
                                          "pending_writes": {"type": "integer"}}}),
             **_BAD, **_AUTH},
            parameters=[{"name": "timeout", "in": "query", "required": False,
                         "schema": {"type": "number", "minimum": 0, "maximum": 600}}])},
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvpool admin API", "version": VERSION,
                 "description": "Every node's admin port. Errors: "
                                '{"error": {"type", "message"}}. With a tokens file, every '
                                "route but /healthz, /readyz, /metrics and /openapi.json "
                                "needs a bearer token: read for reads and lookups, write "
                                "for chunk DELETE and pin/unpin, admin for events, cluster "
                                "changes and /v1/admin/*. Chunk keys are in the token's "
                                "tenant scope (?scope=shared or raw to choose)."},
        "paths": paths,
        "components": {
            "schemas": {"Error": _ERROR, "Node": _NODE, "ClusterMap": _MAP, "Chunk": _CHUNK,
                        "Ready": {"type": "object", "required": ["ready", "reason", "node_id"],
                                  "properties": {"ready": {"type": "boolean"},
                                                 "reason": {"type": "string"},
                                                 "node_id": {"type": "string"}}}},
            "securitySchemes": {"adminToken": {"type": "http", "scheme": "bearer"}}},
    }
