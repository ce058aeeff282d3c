"""Storage, in one home: ``filesystem`` opens a storage URI (a local path or ``s3://bucket/prefix``) as the pyarrow
filesystem every process writes through (the workers, Ray Train, the driver); ``locations`` is what the driver does
with it (pre-flight checks, the datasets/ and runs/ folders, listing, deletion, locks); ``folder_cas`` the
compare-and-swap of a file in a folder, on a local disk or a network filesystem that several hosts share."""
