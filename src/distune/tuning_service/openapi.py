"""The OpenAPI 3 document of the REST API v1, served at ``/api/v1/openapi.json``.

Tests validate it with openapi-spec-validator, check that every route the app serves is in
it, and validate real responses against its schemas, so it cannot drift from the code.
"""

from __future__ import annotations

from typing import Any

from distune.space import BUCKET_SIZE_2P_LIMITS, MODEL_NAME_PATTERN
from distune.tuning_service.dashboard import ASSETS
from distune.tuning_service.messages import MAX_COUNT, SECONDS_RANGE
from distune.tuning_service.trial_board import BOARD_STATES, TRIAL_STATES
from distune.tuning_service.trial_messages import (
    MAX_NODES,
    MAX_TRIAL,
    MODES,
    PURPOSE_PATTERN,
)
from distune.tuning_service.trials.trial_result import METRICS, OUTCOMES


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict[str, Any]:
    meanings = {
        400: "malformed body or field; the message names the field",
        401: "missing or wrong bearer token",
        404: "no model (or trial) of that name (number) exists",
        409: "conflicts with the service's state",
        413: "request body over 1 MiB",
    }
    return {str(status): _json(_ref("Error"), meanings[status]) for status in statuses}


_COUNT = {"type": "integer", "minimum": 1, "maximum": 2**62}
_NAME = {
    "name": "name",
    "in": "path",
    "required": True,
    "description": "the model's name, as given to DistributedDataParallel(name=...)",
    "schema": {"type": "string", "pattern": f"^{MODEL_NAME_PATTERN.pattern}$"},
}

_SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {"type": "string", "description": "what is wrong"}},
    },
    "Hyperparameters": {
        "type": "object",
        "required": ["bucket_size_2p", "is_hierarchical_reduce"],
        "additionalProperties": False,
        "properties": {
            "bucket_size_2p": {
                "type": "integer",
                "minimum": BUCKET_SIZE_2P_LIMITS[0],
                "maximum": BUCKET_SIZE_2P_LIMITS[1],
                "description": "the bucket size is 2**bucket_size_2p bytes",
            },
            "is_hierarchical_reduce": {
                "type": "boolean",
                "description": "intra-node reduce, inter-node allreduce, intra-node broadcast",
            },
        },
    },
    "Group": {
        "type": "object",
        "required": ["id", "hyperparameters"],
        "properties": {
            "id": {
                "type": "integer",
                "minimum": 0,
                "description": "new for every sample; reports name the group they measured",
            },
            "hyperparameters": _ref("Hyperparameters"),
        },
    },
    "State": {"type": "string", "enum": ["warmup", "sampling", "completed"]},
    "Reply": {
        "type": "object",
        "required": ["group", "state", "completed"],
        "properties": {
            "group": _ref("Group"),
            "state": _ref("State"),
            "completed": {"type": "boolean", "description": "the group will not change again"},
        },
    },
    "StaleGroup": {
        "description": "a report for a group that is not current; carries the current group, "
        "or, with state 'superseded', the last group of the registration that sent it, which a "
        "registration of the name with other facts replaced (that model is no longer tuned)",
        "type": "object",
        "required": ["error", "group", "state", "completed"],
        "properties": {
            "error": {"type": "string"},
            "group": _ref("Group"),
            "state": {"oneOf": [_ref("State"), {"const": "superseded"}]},
            "completed": {"type": "boolean"},
        },
    },
    "Registration": {
        "type": "object",
        "required": ["world_size", "nnodes", "local_world_size", "gradient_bytes"],
        "additionalProperties": False,
        "properties": {
            "world_size": _COUNT | {"description": "ranks in the job; nnodes x local_world_size"},
            "nnodes": _COUNT,
            "local_world_size": _COUNT | {"description": "ranks per node"},
            "gradient_bytes": _COUNT
            | {"maximum": 2**48, "description": "bytes of the model's gradients"},
            "fixed": {
                "type": "object",
                "additionalProperties": False,
                "description": "knobs the model pins; merged over the service's --fixed",
                "properties": {
                    "bucket_size_2p": {
                        "type": "integer",
                        "minimum": BUCKET_SIZE_2P_LIMITS[0],
                        "maximum": BUCKET_SIZE_2P_LIMITS[1],
                    },
                    "is_hierarchical_reduce": {"type": "boolean"},
                },
            },
        },
    },
    "Report": {
        "type": "object",
        "required": ["group_id", "train_iter", "iterations", "seconds"],
        "additionalProperties": False,
        "properties": {
            "group_id": {"type": "integer", "minimum": 0, "maximum": MAX_COUNT},
            "train_iter": {
                "type": "integer",
                "minimum": 0,
                "maximum": MAX_COUNT,
                "description": "training iterations done at the end of the window",
            },
            "iterations": {
                "type": "integer",
                "minimum": 1,
                "maximum": MAX_COUNT,
                "description": "iterations in the window",
            },
            "seconds": {
                "type": "number",
                "minimum": SECONDS_RANGE[0],
                "maximum": SECONDS_RANGE[1],
                "description": "the slowest rank's wall-clock seconds for the window",
            },
            "samples": {
                "type": "integer",
                "minimum": 1,
                "maximum": MAX_COUNT,
                "description": "samples in the window: scores become samples per second",
            },
        },
    },
    "Best": {
        "type": "object",
        "required": ["group", "score", "gain_vs_default"],
        "properties": {
            "group": _ref("Group"),
            "score": {"type": "number", "description": "robust throughput over its windows"},
            "gain_vs_default": {"type": "number", "description": "score / default score - 1"},
            "gain_margin": {
                "type": ["number", "null"],
                "description": "half-width of the gain's 95% confidence interval, from the "
                "windows of the group and of the default group",
            },
            "gain_interval": {
                "oneOf": [
                    {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2},
                    {"type": "null"},
                ],
                "description": "the gain's 95% confidence interval, [low, high]",
            },
            "measurably_faster": {
                "type": "boolean",
                "description": "the interval lies above zero; a completed session chooses a "
                "group other than the default only then",
            },
        },
    },
    "ModelStatus": {
        "type": "object",
        "required": [
            "state",
            "samples",
            "max_samples",
            "current",
            "best",
            "default_score",
            "invalid_windows",
        ],
        "properties": {
            "state": _ref("State"),
            "samples": {"type": "integer", "minimum": 0},
            "max_samples": {"type": "integer", "minimum": 1},
            "current": _ref("Group"),
            "best": {
                "oneOf": [_ref("Best"), {"type": "null"}],
                "description": "the best group so far; the choice once completed",
            },
            "default_score": {"type": ["number", "null"]},
            "invalid_windows": {
                "type": "integer",
                "minimum": 0,
                "description": "stalled report windows set aside, not scored",
            },
            "verdict": {
                "type": ["string", "null"],
                "description": "once completed, what the choice means: the gain and its "
                "interval, or 'no group measurably faster than the default: differences "
                "within ±X%'",
            },
            "retunes": {
                "type": "integer",
                "minimum": 0,
                "description": "times tuning reopened because the throughput drifted below "
                "the chosen group's score (--autotune_retune_drift)",
            },
            "registration": _ref("Registration")
            | {"description": "the facts the session tuned now was registered with"},
            "earlier": {
                "type": "array",
                "items": _ref("EarlierRegistration"),
                "description": "sessions of earlier registrations of the name with other "
                "facts, oldest first: a registration with other facts is tuned afresh",
            },
        },
    },
    "EarlierRegistration": {
        "allOf": [_ref("ModelStatus")],
        "type": "object",
        "required": ["registration", "superseded_reports"],
        "properties": {
            "superseded_reports": {
                "type": "integer",
                "minimum": 0,
                "description": "reports it sent after it was replaced (answered 409, "
                "state 'superseded'): more than none means two models trained under one name",
            },
        },
    },
    "Status": {
        "type": "object",
        "required": ["models"],
        "properties": {
            "models": {"type": "object", "additionalProperties": _ref("ModelStatus")},
        },
    },
    "Health": {
        "type": "object",
        "required": ["status", "version"],
        "properties": {
            "status": {"type": "string", "enum": ["ok"]},
            "version": {"type": "string"},
        },
    },
}

_TRIAL = {"type": "integer", "minimum": 0, "maximum": MAX_TRIAL}
_NULLABLE_OBJECT = {"type": ["object", "null"]}
_NULLABLE_STOP = {
    "oneOf": [_ref("TrialsStop"), {"type": "null"}],
    "description": "the first stop any node asked for",
}
_NULLABLE_FINISH = {
    "oneOf": [_ref("TrialsFinish"), {"type": "null"}],
    "description": "the search's end, once node 0 posted it",
}

#: Level 2's trials (trial_board.py): node 0 publishes and records, every node reports.
_TRIAL_SCHEMAS: dict[str, Any] = {
    "TrialKnobs": {
        "type": "object",
        "additionalProperties": False,
        "description": "what a trial sets in every rank; null keeps the script's own value",
        "properties": {
            "micro_batch": {"type": ["integer", "null"], "minimum": 1, "maximum": 2**31},
            "accumulation": {"type": ["integer", "null"], "minimum": 1, "maximum": 2**31},
            "stage": {
                "type": ["integer", "null"],
                "minimum": 0,
                "maximum": 3,
                "description": "0 ddp, 1 zero1, 2 zero2, 3 zero3",
            },
            "checkpointing": {"type": ["boolean", "null"]},
            "bf16": {"type": ["boolean", "null"], "description": "bf16 mixed precision"},
        },
    },
    "TrialSpec": {
        "type": "object",
        "required": ["trial", "nnodes", "purpose", "knobs", "master_port"],
        "additionalProperties": False,
        "properties": {
            "trial": _TRIAL,
            "nnodes": {"type": "integer", "minimum": 1, "maximum": MAX_NODES},
            "purpose": {"type": "string", "pattern": f"^{PURPOSE_PATTERN.pattern}$"},
            "knobs": _ref("TrialKnobs"),
            "master_port": {
                "type": "integer",
                "minimum": 1,
                "maximum": 65535,
                "description": "the trial's rendezvous port on node 0 (--master_addr)",
            },
            "config": _NULLABLE_OBJECT
            | {"description": "the knobs as DeepSpeed's config keys (null for the profile)"},
            "metric": {"type": "string", "enum": list(METRICS)},
            "job": _NULLABLE_OBJECT
            | {
                "description": "node 0's job (script, script_args, world_size, nnodes, "
                "device_memory, pinned): a node started with another refuses the trials"
            },
        },
    },
    "NodeReport": {
        "type": "object",
        "required": ["outcome", "duration"],
        "additionalProperties": False,
        "properties": {
            "outcome": {"type": "string", "enum": list(OUTCOMES)},
            "duration": {"type": "number", "minimum": 0, "maximum": 1e7},
            "error": {"type": ["string", "null"], "description": "e.g. a traceback's tail"},
            "measurements": _NULLABLE_OBJECT
            | {"description": "node 0's: throughput, step time, peak memory of every rank"},
            "peak_memory_bytes": {"type": ["integer", "null"], "minimum": 0},
            "stopped": {
                "type": "boolean",
                "description": "the node's launcher stopped its ranks because a peer failed or "
                "the trial was closed: the outcome is a symptom",
            },
            "failed_at": {
                "type": ["number", "null"],
                "minimum": 0,
                "maximum": 1e11,
                "description": "when the node's first failing rank failed (seconds since the "
                "epoch): of nodes with one outcome, the first to fail explains it",
            },
            "diverged": {
                "type": "boolean",
                "description": "the crash is the model's parameters going NaN or inf",
            },
        },
    },
    "TrialRecord": {
        "type": "object",
        "required": ["trial", "config", "outcome"],
        "description": "one line of trials.jsonl (docs/level2.md lists every field)",
        "properties": {
            "trial": _TRIAL,
            "config": _NULLABLE_OBJECT,
            "outcome": {"type": "string", "enum": list(OUTCOMES)},
            "throughput": {"type": ["number", "null"], "minimum": 0, "maximum": 1e15},
            "step_seconds": {"type": ["number", "null"], "minimum": 0, "maximum": 1e7},
            "peak_memory_bytes": {"type": ["integer", "null"], "minimum": 0, "maximum": 2**62},
            "predicted_memory_bytes": {
                "type": ["integer", "null"],
                "minimum": 0,
                "maximum": 2**62,
            },
            "purpose": {"type": ["string", "null"]},
            "error": {"type": ["string", "null"]},
            "strategy": {"type": ["string", "null"]},
            "log_path": {"type": ["string", "null"]},
        },
    },
    "TrialsFinish": {
        "type": "object",
        "required": ["mode"],
        "additionalProperties": False,
        "properties": {
            "mode": {"type": "string", "enum": list(MODES)},
            "chosen": {"type": ["integer", "null"], "minimum": 0, "maximum": MAX_TRIAL},
            "knobs": {"oneOf": [_ref("TrialKnobs"), {"type": "null"}]},
        },
    },
    "TrialsStop": {
        "type": "object",
        "required": ["node_rank", "reason"],
        "additionalProperties": False,
        "properties": {
            "node_rank": {"type": "integer", "minimum": 0, "maximum": MAX_NODES - 1},
            "reason": {"type": "string", "minLength": 1, "maxLength": 200},
        },
    },
    "Trial": {
        "type": "object",
        "required": ["trial", "state", "spec", "nodes", "missing", "failed", "combined", "record"],
        "properties": {
            "trial": _TRIAL,
            "state": {"type": "string", "enum": list(TRIAL_STATES)},
            "spec": {"oneOf": [_ref("TrialSpec"), {"type": "null"}]},
            "nodes": {
                "type": "object",
                "additionalProperties": _ref("NodeReport"),
                "description": "each reported node's outcome, by node rank",
            },
            "missing": {"type": "array", "items": {"type": "integer"}},
            "failed": {
                "type": "boolean",
                "description": "a node failed on its own: the others stop their ranks",
            },
            "combined": {
                "oneOf": [
                    {
                        "type": "object",
                        "required": ["outcome", "error", "node", "measurements"],
                        "properties": {
                            "outcome": {"type": "string", "enum": list(OUTCOMES)},
                            "error": {"type": ["string", "null"]},
                            "node": {"type": "integer", "minimum": 0},
                            "measurements": _NULLABLE_OBJECT,
                            "peak_memory_bytes": {"type": ["integer", "null"]},
                            "duration": {"type": "number"},
                            "diverged": {"type": "boolean"},
                        },
                    },
                    {"type": "null"},
                ],
                "description": "once every node reported: the first of oom, timeout, crash, "
                "invalid, ok any node reported (a stopped node's only when all stopped)",
            },
            "record": {"oneOf": [_ref("TrialRecord"), {"type": "null"}]},
        },
    },
    "TrialsCurrent": {
        "type": "object",
        "required": ["state", "trial", "finish", "stop", "acknowledged"],
        "properties": {
            "state": {"type": "string", "enum": list(BOARD_STATES)},
            "trial": {"oneOf": [_ref("Trial"), {"type": "null"}]},
            "finish": _NULLABLE_FINISH,
            "stop": _NULLABLE_STOP,
            "acknowledged": {
                "type": "array",
                "items": {"type": "integer"},
                "description": "nodes that have asked (?node_rank=) since the finish or stop",
            },
        },
    },
    "Trials": {
        "type": "object",
        "required": ["state", "nnodes", "metric", "running", "best", "finish", "stop", "trials"],
        "properties": {
            "state": {"type": "string", "enum": list(BOARD_STATES)},
            "nnodes": {"type": ["integer", "null"]},
            "metric": {"type": "string", "enum": list(METRICS)},
            "running": {"oneOf": [_ref("Trial"), {"type": "null"}]},
            "best": {
                "type": ["integer", "null"],
                "description": "the chosen trial once finished, else the best ok trial so far",
            },
            "finish": _NULLABLE_FINISH,
            "stop": _NULLABLE_STOP,
            "trials": {"type": "array", "items": _ref("TrialRecord")},
        },
    },
}
_SCHEMAS.update(_TRIAL_SCHEMAS)

_TRIAL_NUMBER = {
    "name": "trial",
    "in": "path",
    "required": True,
    "schema": {"type": "integer", "minimum": 0},
}
_NODE_RANK = {
    "name": "node_rank",
    "in": "path",
    "required": True,
    "description": "the reporting node's --node_rank",
    "schema": {"type": "integer", "minimum": 0},
}


def _trial_paths(body_of: Any) -> dict[str, Any]:
    trials = "/api/v1/trials"
    overview = _json(_ref("Trials"), "every recorded trial, the running one and the best")
    return {
        trials: {
            "get": {
                "summary": "level 2: every recorded trial (trials.jsonl's records) and the best",
                "operationId": "trials",
                "responses": {"200": overview} | _errors(401),
            },
            "post": {
                "summary": "level 2, node 0: publish the next trial for every node to run",
                "operationId": "publish_trial",
                "requestBody": body_of("TrialSpec"),
                "responses": {"200": _json(_ref("Trial"), "the published trial")}
                | _errors(400, 401, 409, 413),
            },
        },
        f"{trials}/current": {
            "get": {
                "summary": "level 2, every node: the latest trial, and the finish or stop",
                "operationId": "current_trial",
                "parameters": [
                    {
                        "name": "node_rank",
                        "in": "query",
                        "required": False,
                        "description": "the asking node: noted as having seen the end",
                        "schema": {"type": "integer", "minimum": 0, "maximum": MAX_NODES - 1},
                    }
                ],
                "responses": {"200": _json(_ref("TrialsCurrent"), "what to run now")}
                | _errors(400, 401),
            }
        },
        f"{trials}/finish": {
            "post": {
                "summary": "level 2, node 0: the search is over; what every node trains with",
                "operationId": "finish_trials",
                "requestBody": body_of("TrialsFinish"),
                "responses": {"200": overview} | _errors(400, 401, 404, 409, 413),
            }
        },
        f"{trials}/stop": {
            "post": {
                "summary": "level 2, any node: stop the trials on every node",
                "operationId": "stop_trials",
                "requestBody": body_of("TrialsStop"),
                "responses": {"200": overview} | _errors(400, 401, 413),
            }
        },
        f"{trials}/{{trial}}": {
            "get": {
                "summary": "level 2: one trial's node reports, combined outcome and record",
                "operationId": "trial",
                "parameters": [_TRIAL_NUMBER],
                "responses": {"200": _json(_ref("Trial"), "the trial")} | _errors(401, 404),
            }
        },
        f"{trials}/{{trial}}/nodes/{{node_rank}}": {
            "post": {
                "summary": "level 2, every node: how the trial ended on this node",
                "operationId": "report_trial",
                "parameters": [_TRIAL_NUMBER, _NODE_RANK],
                "requestBody": body_of("NodeReport"),
                "responses": {"200": _json(_ref("Trial"), "the trial with this report")}
                | _errors(400, 401, 404, 409, 413),
            }
        },
        f"{trials}/{{trial}}/record": {
            "post": {
                "summary": "level 2, node 0: close the trial with its trials.jsonl record",
                "operationId": "record_trial",
                "parameters": [_TRIAL_NUMBER],
                "requestBody": body_of("TrialRecord"),
                "responses": {"200": _json(_ref("Trial"), "the recorded trial")}
                | _errors(400, 401, 404, 409, 413),
            }
        },
    }


def openapi_document(version: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the service (``version``: distune's)."""

    def body_of(schema: str) -> dict[str, Any]:
        return {"required": True, "content": {"application/json": {"schema": _ref(schema)}}}

    models = "/api/v1/models/{name}"
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "distune tuning service",
            "version": version,
            "description": "Online tuning of data-parallel communication settings, and the "
            "coordination of level 2's trials across a job's nodes.",
        },
        "components": {
            "schemas": _SCHEMAS,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        # Only enforced when the service has DISTUNE_SERVICE_TOKEN in its environment.
        "security": [{"bearer": []}],
        "paths": {
            "/api/v1/health": {
                "get": {
                    "summary": "liveness; never needs the token",
                    "operationId": "health",
                    "security": [],
                    "responses": {"200": _json(_ref("Health"), "the service is up")},
                }
            },
            f"{models}/register": {
                "post": {
                    "summary": "start tuning a model, or resume its session",
                    "description": "the same facts resume the name's session (a restarted "
                    "job); other facts (the model wrapped again, the job on other nodes) start "
                    "a new one, tuned afresh, and keep the old one under /status's earlier; "
                    "409: one registration more than the service's max_models",
                    "operationId": "register",
                    "parameters": [_NAME],
                    "requestBody": body_of("Registration"),
                    "responses": {"200": _json(_ref("Reply"), "the group to run")}
                    | _errors(400, 401, 409, 413),
                }
            },
            f"{models}/report": {
                "post": {
                    "summary": "report one measured window; answers the group to run",
                    "operationId": "report",
                    "parameters": [_NAME],
                    "requestBody": body_of("Report"),
                    "responses": {
                        "200": _json(_ref("Reply"), "the group to run"),
                        "409": _json(_ref("StaleGroup"), "the group is not current"),
                    }
                    | _errors(400, 401, 404, 413),
                }
            },
            f"{models}/hyperparameters": {
                "get": {
                    "summary": "the group a model should run now",
                    "operationId": "hyperparameters",
                    "parameters": [_NAME],
                    "responses": {"200": _json(_ref("Reply"), "the group to run")}
                    | _errors(400, 401, 404),
                }
            },
            f"{models}/log": {
                "get": {
                    "summary": "the model's CSV tuning log, header first",
                    "operationId": "log",
                    "parameters": [_NAME],
                    "responses": {
                        "200": {
                            "description": "one row per sample, then the final choice",
                            "content": {"text/csv": {"schema": {"type": "string"}}},
                        }
                    }
                    | _errors(400, 401, 404),
                }
            },
            "/api/v1/status": {
                "get": {
                    "summary": "every model's tuning state",
                    "operationId": "status",
                    "responses": {"200": _json(_ref("Status"), "per model")} | _errors(401),
                }
            },
            **_trial_paths(body_of),
            "/": {
                "get": {
                    "summary": "the live dashboard page; it asks for the token if one is needed",
                    "operationId": "dashboard",
                    "security": [],
                    "responses": {
                        "200": {
                            "description": "an HTML page polling /status and each model's /log",
                            "content": {"text/html": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
            "/dashboard/{asset}": {
                "get": {
                    "summary": "the dashboard page's script and style",
                    "operationId": "dashboard_asset",
                    "security": [],
                    "parameters": [
                        {
                            "name": "asset",
                            "in": "path",
                            "required": True,
                            "schema": {"type": "string", "enum": sorted(ASSETS)},
                        }
                    ],
                    "responses": {
                        "200": {
                            "description": "the file",
                            "content": {
                                media: {"schema": {"type": "string"}}
                                for media in sorted(set(ASSETS.values()))
                            },
                        },
                        "404": _json(_ref("Error"), "the dashboard has no such file"),
                    },
                }
            },
            "/api/v1/openapi.json": {
                "get": {
                    "summary": "this document",
                    "operationId": "openapi",
                    "responses": {"200": _json({"type": "object"}, "the OpenAPI document")}
                    | _errors(401),
                }
            },
        },
    }
