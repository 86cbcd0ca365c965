"""Wire protocol between the daemon, the SGLang plugin and the simulator (v2; reads v1 too).

This package is the protocol's only implementation. It is pure (builtins only) because the
plugin imports it inside SGLang's scheduler processes. docs/protocol.md is its text.

Read: ``GET /server_info`` -> ``internal_states[i]["dynspec"]``, a :class:`DynspecState`.
Write: ``POST /set_internal_state`` with ``{"server_args": encode_update(table, version)}``;
SGLang's request validation accepts only flat ``str -> number`` maps, so a table travels as
numbered keys (``dynspec_r<i>_max_bs``, ``dynspec_r<i>_k``, v2's ``dynspec_r<i>_k<band>``;
``-1`` = no upper bound).
"""

from tuner.protocol._bands import (
    BAND_EDGES,
    CLASS_EDGES,
    COUNTED_MAX_BATCH,
    N_BANDS,
    N_CLASSES,
    UNKNOWN_BAND,
    BandIndex,
    BandRow,
    BandTable,
    band_agnostic,
    band_of,
    band_table_to_json,
    banded,
    class_of,
    class_range,
    format_band_table,
    is_uniform,
    validate_band_table,
)
from tuner.protocol._base import (
    KEY_PREFIX,
    MAX_INT,
    MAX_ROWS,
    PROTOCOL_VERSION,
    SUPPORTED_PROTOCOLS,
    UNBOUNDED,
    ProtocolError,
    Row,
    Table,
    TableIndex,
    format_table,
    lookup,
    sglang_start_arm,
    table_from_json,
    table_to_json,
    validate_table,
)
from tuner.protocol._readout import (
    COUNTER_FIELDS,
    BandCounter,
    CounterRow,
    DynspecState,
    TreeShape,
    band_counter_deltas,
    counter_deltas,
)
from tuner.protocol._update import (
    as_band_table,
    decode_update,
    encode_update,
    has_dynspec_keys,
)

__all__ = [
    "BAND_EDGES",
    "CLASS_EDGES",
    "COUNTED_MAX_BATCH",
    "COUNTER_FIELDS",
    "KEY_PREFIX",
    "MAX_INT",
    "MAX_ROWS",
    "N_BANDS",
    "N_CLASSES",
    "PROTOCOL_VERSION",
    "SUPPORTED_PROTOCOLS",
    "UNBOUNDED",
    "UNKNOWN_BAND",
    "BandCounter",
    "BandIndex",
    "BandRow",
    "BandTable",
    "CounterRow",
    "DynspecState",
    "ProtocolError",
    "Row",
    "Table",
    "TableIndex",
    "TreeShape",
    "as_band_table",
    "band_agnostic",
    "band_counter_deltas",
    "band_of",
    "band_table_to_json",
    "banded",
    "class_of",
    "class_range",
    "counter_deltas",
    "decode_update",
    "encode_update",
    "format_band_table",
    "format_table",
    "has_dynspec_keys",
    "is_uniform",
    "lookup",
    "sglang_start_arm",
    "table_from_json",
    "table_to_json",
    "validate_band_table",
    "validate_table",
]
