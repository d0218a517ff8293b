/* gateway/main.c — placeholder while the command line is assembled. */
#include <stdio.h>
int main(void) {
    fputs("usage: ragkv COMMAND [options]\n", stderr);
    return 2;
}
