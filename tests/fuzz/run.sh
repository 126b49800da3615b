#!/usr/bin/env bash
# libFuzzer harnesses of the parsers that read what others wrote: the GGUF reader
# (fuzz_gguf), the Jinja lexer/parser/evaluator (fuzz_jinja), the tokenizers and the
# streaming detokenizer (fuzz_tokenizer), the GBNF and JSON Schema compilers with the
# matcher and token masks behind them (fuzz_grammar), the request body -> parameters
# of the API (fuzz_params), the prefix key of a body that $m40_prefix_hash hashes
# (fuzz_prefix), and the streaming output path from token bytes to SSE
# events (fuzz_sse: with the module's UTF-8 repair and event writer, compiled against
# the nginx tree that make configures in build/nginx; skipped before that). Each is
# built with clang and ASan + UBSan
# (every UBSan report is fatal) and runs for SECONDS (default 60) from its committed
# seed corpus (tests/fuzz/corpus/NAME), growing a working corpus under build/fuzz.
#   tests/fuzz/run.sh [SECONDS] [NAME ...]     (make fuzz FUZZ_SECONDS=N)
# FUZZ_TIMEOUT=S: an input that runs longer than S seconds (default 10) is a finding; a
# long run at low priority on a busy machine needs more (a starved process is not a hang).
# A crash leaves its input as build/fuzz/NAME/crash-* and the run fails. Prints one
# "N passed, N failed, 0 skipped" line (a harness passes when it ran clean).
set -u
cd "$(dirname "$0")/../.." || exit 1
SECONDS_EACH=${1:-60}
shift || true
NAMES=("$@")
[ ${#NAMES[@]} -gt 0 ] || NAMES=(gguf jinja tokenizer grammar params prefix sse)
CC=${FUZZ_CC:-clang}
CXX=${FUZZ_CXX:-clang++}
out=build/fuzz
mkdir -p "$out"
if ! command -v "$CC" >/dev/null 2>&1; then
    echo "no $CC: fuzzing skipped (scripts/install-deps.sh installs clang)"
    echo "0 passed, 0 failed, 1 skipped"
    exit 0
fi
SAN="-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
FLAGS="-g -O1 -D_GNU_SOURCE -Iengine -Ikernels -pthread"
SRCS=(engine/util/err.c engine/util/hash.c engine/util/threadpool.c engine/gguf/gguf.c engine/gguf/gguf_writer.c
      engine/gguf/mkmodel.c engine/tokenizer/tokenizer.c engine/tokenizer/bpe.c engine/tokenizer/spm_proto.c
      engine/template/jinja_*.c engine/grammar/*.c engine/serve/api_params.c engine/serve/chat_parse.c engine/serve/prefix_key.c
      kernels/ref/ggml_types.c kernels/ref/quant.c)
LIBS="-ljansson -lpcre2-8 -lsentencepiece -lstdc++ -lm"
# the engine's sources once, instrumented (a library every harness links)
objs=()
for f in "${SRCS[@]}"; do
    o="$out/obj/$(echo "$f" | tr / _).o"
    mkdir -p "$out/obj"
    if [ ! -f "$o" ] || [ "$f" -nt "$o" ]; then
        $CC -std=c11 $FLAGS $SAN -c "$f" -o "$o" || { echo "fuzz: cannot build $f"; echo "0 passed, 1 failed, 0 skipped"; exit 1; }
    fi
    objs+=("$o")
done
o="$out/obj/spm_shim.o"
if [ ! -f "$o" ] || [ engine/tokenizer/spm_shim.cc -nt "$o" ]; then
    $CXX -std=c++17 $FLAGS $SAN -c engine/tokenizer/spm_shim.cc -o "$o" || { echo "0 passed, 1 failed, 0 skipped"; exit 1; }
fi
objs+=("$o")
# fuzz_sse: the module's output code, built against nginx's headers. Its other functions
# call into nginx (send a header, log), which is not here: tests/fuzz/nginx_absent.c
# stands in for those calls and aborts if one is ever reached.
NGX=build/nginx
NGX_INC="-I$NGX/src/core -I$NGX/src/event -I$NGX/src/event/modules -I$NGX/src/os/unix -I$NGX/objs
         -I$NGX/src/http -I$NGX/src/http/modules -Ingx_m40_module"
passed=0 failed=0 skipped=0
for name in "${NAMES[@]}"; do
    bin="$out/fuzz_$name"
    extra=() hflags=""
    if [ "$name" = sse ]; then
        if [ ! -f "$NGX/objs/ngx_auto_config.h" ]; then
            echo "fuzz_sse: skipped (no configured nginx tree in $NGX: run make first)"
            skipped=$((skipped + 1)); continue
        fi
        hflags="$NGX_INC"
        o="$out/obj/ngx_http_m40_output.o"
        if ! $CC -std=c11 $FLAGS $SAN $hflags -c ngx_m40_module/ngx_http_m40_output.c -o "$o"; then
            echo "fuzz_sse: build failed"; failed=$((failed + 1)); continue
        fi
        a="$out/obj/nginx_absent.o"
        if ! $CC -std=c11 $FLAGS $SAN $hflags -c tests/fuzz/nginx_absent.c -o "$a"; then
            echo "fuzz_sse: build failed"; failed=$((failed + 1)); continue
        fi
        extra=("$o" "$a")
    fi
    # linked by the C++ driver: the SentencePiece shim's UBSan checks need its runtime
    if ! $CC -std=c11 $FLAGS $SAN $hflags -c "tests/fuzz/fuzz_$name.c" -o "$out/obj/fuzz_$name.o" ||
        ! $CXX $FLAGS -fsanitize=fuzzer,address,undefined "$out/obj/fuzz_$name.o" "${extra[@]}" "${objs[@]}" $LIBS -o "$bin"; then
        echo "fuzz_$name: build failed"; failed=$((failed + 1)); continue
    fi
    work="$out/$name"
    mkdir -p "$work/corpus"
    log="$work/log"
    # -rss_limit_mb: a leak or a blow-up is a finding too; -max_len: inputs up to 64 KB,
    # except where the cost grows with the length and no code of ours needs more (the
    # numbers are in tests/fuzz/README.md): the tokenizer 512 bytes, fuzz_sse the 4 KB it
    # reads at most (longer inputs were executions that tested nothing)
    case $name in
        tokenizer) max_len=512 ;;
        sse) max_len=4096 ;;
        *) max_len=65536 ;;
    esac
    if (cd "$work" && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
        "../fuzz_$name" -max_total_time="$SECONDS_EACH" -max_len=$max_len -rss_limit_mb=2048 -timeout="${FUZZ_TIMEOUT:-10}" \
        -print_final_stats=1 corpus "$OLDPWD/tests/fuzz/corpus/$name" >"log" 2>&1); then
        execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$')
        echo "fuzz_$name: clean, ${execs:-?} executions in ${SECONDS_EACH} s"
        passed=$((passed + 1))
    else
        echo "fuzz_$name: FAILED (input and report in $work):"
        grep -E "ERROR|SUMMARY|runtime error|==[0-9]+==" "$log" | head -20
        failed=$((failed + 1))
    fi
done
echo "$passed passed, $failed failed, $skipped skipped"
[ "$failed" -eq 0 ]
