SET LOCAL synchronous_commit = off; SET LOCAL lock_timeout = '20ms'
