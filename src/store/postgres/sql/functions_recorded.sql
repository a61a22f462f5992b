SELECT file, checksum, generation FROM tokenlease_functions
