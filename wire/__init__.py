"""The wire: typed msgpack messages every process speaks (router <-> workers in `wire.protocol`,
the typed codec in `wire.codec`). It belongs to no role and imports none; roles import it."""
