# bash completion for moeepctl; installed as
# $(pkg-config --variable=completionsdir bash-completion)/moeepctl.

_moeepctl() {
        local cur prev words cword
        _init_completion 2>/dev/null || {
                cur=${COMP_WORDS[COMP_CWORD]}
                prev=${COMP_WORDS[COMP_CWORD - 1]}
                words=("${COMP_WORDS[@]}")
                cword=$COMP_CWORD
        }
        local commands="status jobs clients nics mesh metrics log-level drain help"
        local options="--socket --admin-socket --client --json --help --version"
        local i command=""

        for ((i = 1; i < cword; i++)); do
                case ${words[i]} in
                -s | --socket | -a | --admin-socket) ((i++)) ;;
                -*) ;;
                *)
                        command=${words[i]}
                        break
                        ;;
                esac
        done

        case $prev in
        -s | --socket | -a | --admin-socket)
                COMPREPLY=($(compgen -f -- "$cur"))
                return
                ;;
        esac

        case $command in
        "")
                COMPREPLY=($(compgen -W "$commands $options" -- "$cur"))
                ;;
        log-level)
                COMPREPLY=($(compgen -W "err warning notice info debug --json" -- "$cur"))
                ;;
        drain)
                COMPREPLY=($(compgen -W "--off --json" -- "$cur"))
                ;;
        *)
                COMPREPLY=($(compgen -W "--json" -- "$cur"))
                ;;
        esac
}
complete -F _moeepctl moeepctl
