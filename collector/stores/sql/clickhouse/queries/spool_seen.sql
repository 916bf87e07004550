-- Whether a spool file was ingested: one row when it was.
SELECT toInt32(1) AS seen FROM spool_files WHERE sha256 = {sha256:Nullable(String)} LIMIT 1
