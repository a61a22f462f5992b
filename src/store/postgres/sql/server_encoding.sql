SELECT current_setting('server_encoding')
