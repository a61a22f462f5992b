SELECT success, result FROM run_command_on_all_nodes($1, true, true)
