"""The collector's receivers: OTLP/HTTP (its app, body budget and encodings) and the spool
directory, and the receive path they share (decompress, decode, normalize)."""
