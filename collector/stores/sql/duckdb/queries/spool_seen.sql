SELECT 1 AS seen FROM spool_files WHERE sha256 = $sha256
