"""Data of the tokenizers this project writes into its checkpoints: the chat templates (a simplified
harmony one for the random presets, GPT-OSS's harmony format for the demo model) and the English text the
tiny tokenizers' merges are trained on."""

from __future__ import annotations

# GPT-OSS harmony, simplified: no channels, the generation prompt opens the assistant's message.
# Content may be a string or a list of {"type": "text", "text": ...} parts.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|start|>{{ message['role'] }}<|message|>"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}{{ part['text'] }}{%- endfor -%}{%- endif -%}"
    "<|end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant<|message|>{%- endif -%}"
)

# The training text. Varied, plain English so that frequent words and word pieces get merged first.
CORPUS = """\
The model reads a prompt, turns it into tokens, and then predicts the next token one step at a time.
Each step of decoding needs the keys and values of every earlier token, so the engine keeps them in a
cache. When the cache is full, the oldest requests have to wait, or the scheduler moves them to another
machine. A good inference engine keeps the GPU busy: it batches many requests together, it overlaps
memory copies with compute, and it never waits for the host when it does not have to.

Prefill and decode are very different workloads. Prefill processes the whole prompt at once and is
limited by arithmetic; decode produces one token per request per step and is limited by memory
bandwidth, because every weight has to be read for every step. That is why small batches are slow and
why people work so hard to fuse kernels, quantize weights, and share the cache between requests.

A mixture of experts model sends each token to only a few experts. The router scores all of the experts,
picks the top four, and mixes their outputs with weights that sum to one. Most of the parameters live in
the experts, but each token touches only a small part of them, so the model is large and still fast.

The weather this morning was cold and grey. By noon the clouds had broken up and the sun came out, and
in the afternoon it was warm enough to sit outside. Tomorrow there will be rain in the north and strong
wind along the coast, with temperatures between 12 and 18 degrees. Take an umbrella if you go out early.
Summer days are long and bright; winter nights are long and dark. Spring brings flowers, and autumn
brings falling leaves, fog, and the first frost of the year.

To make a simple soup, chop two onions, three carrots and a few potatoes. Warm some oil in a large pot,
add the onions, and cook them slowly until they are soft. Add the carrots, the potatoes and one litre of
water, then let it simmer for about thirty minutes. Season with salt and pepper, and serve it hot with
fresh bread. If you like, you can add a little cream, some garlic, or a handful of green herbs at the end.
Cooking is easy when you taste as you go, and the kitchen always smells good when bread is in the oven.

Numbers are everywhere: 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 16, 32, 64, 100, 128, 256, 512, 1000, 1024,
2048, 4096 and 65536. The year 2024 had 366 days. Pi is about 3.14159, and e is about 2.71828. One
hundred and twenty is 120; a third of it is 40. The answer is 42. Prices went up by 7.5% last year, from
$19.99 to $21.49. Call me at 555-0100 between 9:00 and 17:30, or write to the office before 1 March.

Punctuation matters. Commas, periods, colons: and semicolons; all have a job. "Quotes" and 'single
quotes' mark speech. Questions end with a question mark? Surprise ends with an exclamation mark!
Parentheses (like these) and brackets [like these] and braces {like these} hold extra words. A dash -
or a hyphen, a slash / or a backslash \\, an ampersand & and an at sign @ are all symbols. Lists use
bullets * or numbers 1. 2. 3. Code uses = and == and != and <= and >= and -> and => and :: and //.

She said that she would come back later, but he did not think she would. They have been friends for a
long time, and they know each other well. We were going to the market when it started to rain, so we
went into a small cafe and drank tea until it stopped. I don't know what you mean; it's not what I said.
You're right, we'll see. What is your name? Where do you live? How old are you? Why is the sky blue?
Because light from the sun is scattered by the air, and blue light is scattered more than red light.

Computers store everything as numbers. Text becomes bytes, bytes become tokens, and tokens become
vectors. A byte has eight bits and can hold 256 different values. Unicode gives every character a code
point, and UTF-8 writes each code point as one to four bytes. Letters like a, b and c take one byte;
letters like é, ü and ñ take two; most Chinese characters like 中 and 文 take three; and an emoji like
🙂 takes four. A tokenizer that works on bytes can read any text at all, in any language.

The server accepts requests over HTTP and streams the answer back as it is generated. Each request has
a prompt, a maximum number of new tokens, a temperature and a stop condition. A temperature of zero
means greedy decoding: always take the most likely token. A higher temperature makes the output more
random and more creative. The first token takes the longest, because the whole prompt must be
processed before anything can come out. After that, tokens arrive at a steady rate.

Good software is tested. Every function should do one thing, and do it well. Write the test first,
watch it fail, then make it pass. Keep the code simple, name things clearly, and delete what you do not
need. When a test fails, read the error message carefully: it usually tells you exactly what went
wrong. Measure before you optimize, and measure again after, because the slow part is rarely where you
think it is.

The train left the station at seven in the evening and arrived in the city just after midnight. The
streets were quiet, the shops were closed, and only a few windows were still lit. A cat crossed the
road, looked at the travellers, and disappeared under a parked car. At the hotel, the night porter gave
them the key to room 204 on the second floor. They slept well and woke up late the next morning.

Learning a language takes time. Read every day, listen to people speak, and do not be afraid to make
mistakes. New words are easier to remember when you use them in a sentence. Children learn by playing,
by asking questions, and by copying the people around them. Adults can learn just as well, but they
often need more patience and more practice. The best teacher is curiosity, and the best time is now.

The graphics processor has thousands of small cores that run the same program on different data. Its
memory is fast but limited, so large models are split across several devices. The matrix units can
multiply small tiles of numbers in a single instruction, and they are fastest with low precision
formats such as bfloat16, float8 and even four bit numbers. Data moves from global memory to shared
memory to registers, and the art of writing a kernel is to keep every unit fed without waiting.

A chat is a list of messages. Each message has a role and some content. The system message sets the
rules, the developer message gives instructions, the user message asks a question, and the assistant
message is the answer. The user asks, the assistant answers, and the system decides how the assistant
should behave. An assistant can think in one channel and answer in another, call a tool, read the
result, and then give the user a final answer. Hello! How can I help you today? Thank you, that is all.
system: You are a helpful assistant. Answer briefly.
user: What does a GPU do?
assistant: A GPU runs the same small program on many numbers at once, so it is fast at matrix math.
user: What will the weather be like tomorrow?
assistant: Rain in the morning, then sun. The weather should be warm by the afternoon.
developer: Keep every answer short and friendly.
"""


# GPT-OSS' harmony chat format, rendered the way the gpt-oss chat template does (openai/gpt-oss-20b's
# chat_template.jinja), written for the demo model; the same prompt for the same chat (no current date).
#   <|start|>system<|message|>{model_identity}\nKnowledge cutoff: 2024-06\n\nReasoning: {effort}\n\n
#     # Valid channels: analysis, commentary, final. Channel must be included for every message.
#     [\nCalls to these tools must go to the commentary channel: 'functions'.]<|end|>
#   [<|start|>developer<|message|>[# Instructions\n\n{first system/developer message}][\n\n]
#     [# Tools\n\n## functions\n\nnamespace functions {\n\n// {description}\ntype add = (_: {\n
#      a: number,\nb: number,\n}) => any;\n\n} // namespace functions]<|end|>]
#   <|start|>user<|message|>{content}<|end|>
#   <|start|>assistant<|channel|>final<|message|>{content}<|end|>            (earlier answers; no CoT)
#   <|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>{args}<|call|>
#   <|start|>functions.{name} to=assistant<|channel|>commentary<|message|>{tool content}<|end|>
#   <|start|>assistant                                                       (the generation prompt)
# Variables: messages, tools (OpenAI function tools), reasoning_effort (low|medium|high; default medium),
# model_identity, add_generation_prompt. A tool call's arguments may be a JSON string (OpenAI) or a dict
# (transformers; rendered with tojson: {"a": 1, "b": 2}).
HARMONY_CHAT_TEMPLATE = r"""{#- GPT-OSS harmony chat format (after openai/gpt-oss' chat_template.jinja; no current date).
  Variables: messages, tools (OpenAI function tools), reasoning_effort (low | medium | high, default medium),
  model_identity, add_generation_prompt. An assistant message without tool calls whose `channel` is
  "commentary" (a preamble, as /v1/responses passes it) is rendered on that channel, not as a final answer. -#}
{%- macro text_of(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}{{- content -}}
    {%- elif content is mapping -%}{{- content | tojson -}}
    {%- elif content is sequence -%}
        {%- for part in content -%}
            {%- if part is string -%}{{- part -}}{%- else -%}{{- part['text'] -}}{%- endif -%}
        {%- endfor -%}
    {%- else -%}{{- content | tojson -}}
    {%- endif -%}
{%- endmacro -%}
{%- macro ts_type(spec) -%}
    {%- if spec['type'] == "integer" or spec['type'] == "number" -%}{{- "number" -}}
    {%- elif spec['type'] == "string" and spec['enum'] -%}{{- '"' + spec['enum'] | join('" | "') + '"' -}}
    {%- elif spec['type'] == "string" -%}{{- "string" -}}
    {%- elif spec['type'] == "boolean" -%}{{- "boolean" -}}
    {%- elif spec['type'] == "array" and spec['items'] -%}{{- ts_type(spec['items']) + "[]" -}}
    {%- elif spec['type'] == "array" -%}{{- "any[]" -}}
    {%- elif spec['type'] == "object" -%}{{- "object" -}}
    {%- else -%}{{- "any" -}}
    {%- endif -%}
    {%- if spec['nullable'] -%}{{- " | null" -}}{%- endif -%}
{%- endmacro -%}
{%- macro render_functions(tools) -%}
    {{- "## functions\n\nnamespace functions {\n\n" -}}
    {%- for tool in tools -%}
        {%- set fn = tool['function'] if tool['function'] is defined else tool -%}
        {%- if fn['description'] -%}{{- "// " + fn['description'] + "\n" -}}{%- endif -%}
        {{- "type " + fn['name'] + " = (" -}}
        {%- set params = fn['parameters'] or {} -%}
        {%- if params['properties'] -%}
            {{- "_: {\n" -}}
            {%- for pname, pspec in params['properties'].items() -%}
                {%- if pspec['description'] -%}{{- "// " + pspec['description'] + "\n" -}}{%- endif -%}
                {{- pname -}}
                {%- if pname not in (params['required'] or []) -%}{{- "?" -}}{%- endif -%}
                {{- ": " + ts_type(pspec) -}}
                {%- if pspec['default'] is defined -%}{{- ", // default: " + pspec['default'] | tojson -}}{%- endif -%}
                {{- ",\n" -}}
            {%- endfor -%}
            {{- "}) => any;\n\n" -}}
        {%- else -%}
            {{- ") => any;\n\n" -}}
        {%- endif -%}
    {%- endfor -%}
    {{- "} // namespace functions" -}}
{%- endmacro -%}
{%- if model_identity is not defined or not model_identity -%}
    {%- set model_identity = "You are a tiny GPT-OSS trained by gigadecode to add two numbers." -%}
{%- endif -%}
{%- if reasoning_effort is not defined or not reasoning_effort -%}
    {%- set reasoning_effort = "medium" -%}
{%- endif -%}
{{- "<|start|>system<|message|>" + model_identity + "\nKnowledge cutoff: 2024-06\n\nReasoning: " + reasoning_effort -}}
{{- "\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message." -}}
{%- if tools -%}{{- "\nCalls to these tools must go to the commentary channel: 'functions'." -}}{%- endif -%}
{{- "<|end|>" -}}
{%- if messages and (messages[0]['role'] == "developer" or messages[0]['role'] == "system") -%}
    {%- set instructions = text_of(messages[0]['content']) -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set instructions = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- if instructions or tools -%}
    {{- "<|start|>developer<|message|>" -}}
    {%- if instructions -%}
        {{- "# Instructions\n\n" + instructions -}}
        {%- if tools -%}{{- "\n\n" -}}{%- endif -%}
    {%- endif -%}
    {%- if tools -%}{{- "# Tools\n\n" + render_functions(tools) -}}{%- endif -%}
    {{- "<|end|>" -}}
{%- endif -%}
{%- set state = namespace(fn=none) -%}
{%- for message in loop_messages -%}
    {%- if message['role'] == "user" -%}
        {{- "<|start|>user<|message|>" + text_of(message['content']) + "<|end|>" -}}
    {%- elif message['role'] == "assistant" -%}
        {%- set thinking = message['thinking'] or message['reasoning_content'] or message['reasoning'] or "" -%}
        {%- if message['tool_calls'] -%}
            {%- set preamble = thinking or text_of(message['content']) -%}
            {%- if preamble -%}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + preamble + "<|end|>" -}}
            {%- endif -%}
            {%- for call in message['tool_calls'] -%}
                {%- set fn = call['function'] if call['function'] is defined else call -%}
                {{- "<|start|>assistant<|channel|>commentary to=functions." + fn['name'] + " <|constrain|>json<|message|>" -}}
                {%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}{%- else -%}{{- fn['arguments'] | tojson -}}{%- endif -%}
                {{- "<|call|>" -}}
                {%- set state.fn = fn['name'] -%}
            {%- endfor -%}
        {%- elif message['channel'] == "commentary" -%}
            {#- a preamble that no call followed (harmony's commentary channel without a recipient) -#}
            {{- "<|start|>assistant<|channel|>commentary<|message|>" + text_of(message['content']) + "<|end|>" -}}
        {%- elif loop.last and not add_generation_prompt -%}
            {%- if thinking -%}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + thinking + "<|end|>" -}}
            {%- endif -%}
            {{- "<|start|>assistant<|channel|>final<|message|>" + text_of(message['content']) + "<|return|>" -}}
        {%- else -%}
            {{- "<|start|>assistant<|channel|>final<|message|>" + text_of(message['content']) + "<|end|>" -}}
        {%- endif -%}
    {%- elif message['role'] == "tool" -%}
        {%- set name = message['name'] or state.fn -%}
        {%- if not name -%}
            {{- raise_exception("a tool message needs an earlier assistant message with a tool call") -}}
        {%- endif -%}
        {{- "<|start|>functions." + name + " to=assistant<|channel|>commentary<|message|>" + text_of(message['content']) + "<|end|>" -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- "<|start|>assistant" -}}{%- endif -%}
"""
