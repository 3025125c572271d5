#compdef justllm

_justllm_completion() {
  eval $(env TERMINAL_WIDTH=100000 _TYPER_COMPLETE_ARGS="${words[1,$CURRENT]}" _JUSTLLM_COMPLETE=complete_zsh justllm)
}

compdef _justllm_completion justllm
