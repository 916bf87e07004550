"""OTLP bodies into the typed tables' columns: the Python normalizer, the compiled decoder
(fastotlp*.c) and the tables' column order both fill."""
