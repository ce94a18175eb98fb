// router/validate: every GenerateRequest and TokenizeRequest field at and past its limits; the
// message names the field.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

extern "C" {
#include "router/validate.h"
}

namespace {

using Chat = std::vector<std::pair<std::string, std::string>>;  // (role, content)

// The ChatMessage messages of (role, content) pairs, in msgs, pointed to by ptrs (both rebuilt).
void chat_messages(const std::vector<std::pair<std::string, std::string>> &chat,
                   std::vector<Metrale__V1__ChatMessage> *msgs, std::vector<Metrale__V1__ChatMessage *> *ptrs) {
    msgs->assign(chat.size(), Metrale__V1__ChatMessage METRALE__V1__CHAT_MESSAGE__INIT);
    ptrs->clear();
    for (size_t i = 0; i < chat.size(); i++) {
        (*msgs)[i].role = (char *)chat[i].first.c_str();
        (*msgs)[i].content = (char *)chat[i].second.c_str();
        ptrs->push_back(&(*msgs)[i]);
    }
}

// A valid request that a case then breaks; owns the storage the protobuf-c struct points into.
struct Req {
    Metrale__V1__GenerateRequest r = METRALE__V1__GENERATE_REQUEST__INIT;
    Metrale__V1__SamplingParams s = METRALE__V1__SAMPLING_PARAMS__INIT;
    Metrale__V1__StoppingCriteria st = METRALE__V1__STOPPING_CRITERIA__INIT;
    std::string id = "req-1", text, kwargs;
    std::vector<uint32_t> prompt{1, 2, 3}, stops;
    std::vector<std::string> stop_strings;
    std::vector<std::pair<std::string, std::string>> chat;  // (role, content)
    // storage the pointers below point into, rebuilt by get()
    std::vector<char *> stop_ptrs;
    std::vector<Metrale__V1__ChatMessage> msgs;
    std::vector<Metrale__V1__ChatMessage *> msg_ptrs;
    Req() { st.max_new_tokens = 8; }
    // A text prompt instead of ids.
    void use_text(const std::string &t) { prompt.clear(); text = t; }
    // A chat prompt instead of ids.
    void use_chat(std::vector<std::pair<std::string, std::string>> c) { prompt.clear(); chat = std::move(c); }
    const Metrale__V1__GenerateRequest *get() {
        r.request_id = (char *)id.c_str();
        r.prompt_text = (char *)text.c_str();
        r.chat_template_kwargs = (char *)kwargs.c_str();
        r.n_prompt_token_ids = prompt.size();
        r.prompt_token_ids = prompt.data();
        st.n_stop_token_ids = stops.size();
        st.stop_token_ids = stops.data();
        stop_ptrs.clear();
        for (std::string &x : stop_strings) stop_ptrs.push_back((char *)x.c_str());
        st.n_stop = stop_ptrs.size();
        st.stop = stop_ptrs.data();
        chat_messages(chat, &msgs, &msg_ptrs);
        r.n_messages = msg_ptrs.size();
        r.messages = msg_ptrs.data();
        if (!r.sampling) r.sampling = &s;
        if (!r.stopping) r.stopping = &st;
        return &r;
    }
};

const rtr_model_limits kLim = {300, 64, true, true};  // vocab 300, context 64, tokenizer and template
const rtr_model_limits kNoTokenizer = {300, 64, false, false};
const rtr_model_limits kNoTemplate = {300, 64, true, false};

const std::string kBadUtf8[] = {
    "\x80",              // a lone continuation byte
    "\xc3",              // truncated
    "\xc0\xaf",          // overlong '/'
    "\xe0\x80\xaf",      // overlong
    "\xed\xa0\x80",      // a surrogate (U+D800)
    "\xf4\x90\x80\x80",  // past U+10FFFF
    "\xf5\x80\x80\x80",  // not a lead byte
    "\xff",
    "\xe2\x82",          // truncated euro sign
};

struct Case {
    const char *name;
    std::function<void(Req &)> edit;
    const char *field;  // nullptr: valid
};

std::vector<Case> cases() {
    return {
        {"valid as is", [](Req &) {}, nullptr},
        {"every knob at its top", [](Req &q) {
             q.s.temperature = 100; q.s.top_p = 1; q.s.top_k = 1 << 30; q.s.min_p = 1; q.s.repetition_penalty = 10;
             q.s.presence_penalty = 2; q.s.frequency_penalty = -2; q.s.has_seed = true; q.s.seed = 99;
             q.r.logprobs = true; q.r.top_logprobs = 20; q.stops = std::vector<uint32_t>(64, 299);
             q.id = std::string(128, '~'); q.st.max_new_tokens = 61; q.st.ignore_eos = true;
         }, nullptr},
        {"prompt fills the context", [](Req &q) { q.prompt.assign(63, 299); q.st.max_new_tokens = 1; }, nullptr},
        {"no sampling message", [](Req &q) { q.r.sampling = nullptr; }, nullptr},
        {"empty id", [](Req &q) { q.id = ""; }, "request_id"},
        {"id of 129", [](Req &q) { q.id = std::string(129, 'a'); }, "request_id"},
        {"id with newline", [](Req &q) { q.id = "a\nb"; }, "request_id byte 1"},
        {"id with DEL", [](Req &q) { q.id = "a\x7f"; }, "request_id"},
        {"id with UTF-8", [](Req &q) { q.id = "caf\xc3\xa9"; }, "request_id byte 3"},
        {"empty prompt", [](Req &q) { q.prompt.clear(); }, "prompt is empty: set one of prompt_token_ids"},
        {"token == vocab", [](Req &q) { q.prompt = {1, 300}; }, "prompt_token_ids[1] = 300"},
        {"token max", [](Req &q) { q.prompt = {UINT32_MAX}; }, "prompt_token_ids[0]"},
        {"prompt over context", [](Req &q) { q.prompt.assign(65, 1); }, "prompt_token_ids has 65"},
        {"prompt + new over context", [](Req &q) { q.prompt.assign(60, 1); q.st.max_new_tokens = 5; }, "max_context 64"},
        {"max_new overflow", [](Req &q) { q.st.max_new_tokens = UINT32_MAX; }, "max_context"},
        // the prompt: exactly one of ids, text, messages
        {"prompt_text", [](Req &q) { q.use_text("hi"); }, nullptr},
        {"prompt_text UTF-8", [](Req &q) { q.use_text("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80 \xef\xbf\xbf"); }, nullptr},
        {"ids and text", [](Req &q) { q.text = "hi"; }, "prompt_token_ids and prompt_text are set"},
        {"ids and messages", [](Req &q) { q.chat = {{"user", "hi"}}; }, "prompt_token_ids and messages are set"},
        {"text and messages", [](Req &q) { q.use_text("hi"); q.chat = {{"user", "hi"}}; },
         "prompt_text and messages are set"},
        {"all three", [](Req &q) { q.text = "hi"; q.chat = {{"user", "hi"}}; },
         "prompt_token_ids and prompt_text and messages are set"},
        {"text not UTF-8", [](Req &q) { q.use_text("ab\xff"); }, "prompt_text is not valid UTF-8 (byte 2"},
        {"text: only max_new < context", [](Req &q) { q.use_text(std::string(1000, 'a')); q.st.max_new_tokens = 63; },
         nullptr},
        {"text: max_new == context", [](Req &q) { q.use_text("hi"); q.st.max_new_tokens = 64; },
         "stopping.max_new_tokens = 64: must be < max_context 64"},
        {"messages", [](Req &q) { q.use_chat({{"system", ""}, {"user", "hi"}, {"assistant", "yo"}}); }, nullptr},
        {"messages with kwargs", [](Req &q) { q.use_chat({{"user", "hi"}}); q.kwargs = "{\"enable_thinking\": false}"; },
         nullptr},
        {"messages: max_new == context", [](Req &q) { q.use_chat({{"user", "hi"}}); q.st.max_new_tokens = 64; },
         "stopping.max_new_tokens"},
        {"4096 messages", [](Req &q) { q.use_chat(Chat(4096, {"user", "a"})); }, nullptr},
        {"4097 messages", [](Req &q) { q.use_chat(Chat(4097, {"user", "a"})); }, "messages has 4097 entries"},
        {"empty role", [](Req &q) { q.use_chat({{"user", "a"}, {"", "b"}}); }, "messages[1].role is empty"},
        {"role of 64", [](Req &q) { q.use_chat({{std::string(64, 'r'), "a"}}); }, nullptr},
        {"role of 65", [](Req &q) { q.use_chat({{std::string(65, 'r'), "a"}}); }, "messages[0].role has 65 bytes"},
        {"role not UTF-8", [](Req &q) { q.use_chat({{"us\xc3", "a"}}); }, "messages[0].role is not valid UTF-8"},
        {"content not UTF-8", [](Req &q) { q.use_chat({{"user", "a"}, {"user", "\xed\xa0\x80"}}); },
         "messages[1].content is not valid UTF-8 (byte 0"},
        {"kwargs at the limit", [](Req &q) { q.use_chat({{"user", "a"}}); q.kwargs = std::string(MT_WIRE_KWARGS_BYTES_MAX, ' '); },
         nullptr},
        {"kwargs too long", [](Req &q) { q.use_chat({{"user", "a"}}); q.kwargs = std::string(MT_WIRE_KWARGS_BYTES_MAX + 1, ' '); },
         "chat_template_kwargs has 65537 bytes"},
        {"kwargs not UTF-8", [](Req &q) { q.use_chat({{"user", "a"}}); q.kwargs = "{\"a\": \"\x80\"}"; },
         "chat_template_kwargs is not valid UTF-8"},
        {"kwargs not UTF-8 beside text", [](Req &q) { q.use_text("a"); q.kwargs = "\xff"; }, "chat_template_kwargs"},
        {"add_special_tokens with has", [](Req &q) { q.use_text("a"); q.r.has_add_special_tokens = true; q.r.add_special_tokens = true; },
         nullptr},
        {"add_special_tokens without has", [](Req &q) { q.use_text("a"); q.r.add_special_tokens = true; },
         "has_add_special_tokens"},
        {"echo with top_logprobs", [](Req &q) { q.r.echo = true; q.r.top_logprobs = 3; }, nullptr},
        // stop strings
        {"16 stop strings at 256 bytes", [](Req &q) { q.stop_strings.assign(16, std::string(256, 's')); }, nullptr},
        {"stop string of UTF-8", [](Req &q) { q.stop_strings = {"\xe2\x82\xac", "\n\n"}; q.st.include_stop_str = true; },
         nullptr},
        {"17 stop strings", [](Req &q) { q.stop_strings.assign(17, "x"); }, "stopping.stop has 17 strings"},
        {"empty stop string", [](Req &q) { q.stop_strings = {"a", ""}; }, "stopping.stop[1] is empty"},
        {"stop string of 257", [](Req &q) { q.stop_strings = {std::string(257, 's')}; }, "stopping.stop[0] has 257 bytes"},
        {"stop string not UTF-8", [](Req &q) { q.stop_strings = {"a", "b\xc3"}; }, "stopping.stop[1] is not valid UTF-8"},
        {"temperature < 0", [](Req &q) { q.s.temperature = -0.01f; }, "sampling.temperature"},
        {"temperature > 100", [](Req &q) { q.s.temperature = 100.5f; }, "sampling.temperature"},
        {"temperature NaN", [](Req &q) { q.s.temperature = NAN; }, "sampling.temperature"},
        {"temperature inf", [](Req &q) { q.s.temperature = INFINITY; }, "sampling.temperature"},
        {"top_p > 1", [](Req &q) { q.s.top_p = 1.0001f; }, "sampling.top_p"},
        {"top_p < 0", [](Req &q) { q.s.top_p = -1; }, "sampling.top_p"},
        {"top_k < 0", [](Req &q) { q.s.top_k = -1; }, "sampling.top_k = -1"},
        {"min_p > 1", [](Req &q) { q.s.min_p = 2; }, "sampling.min_p"},
        {"min_p NaN", [](Req &q) { q.s.min_p = NAN; }, "sampling.min_p"},
        {"repetition > 10", [](Req &q) { q.s.repetition_penalty = 10.5f; }, "sampling.repetition_penalty"},
        {"repetition < 0", [](Req &q) { q.s.repetition_penalty = -1; }, "sampling.repetition_penalty"},
        {"presence > 2", [](Req &q) { q.s.presence_penalty = 2.5f; }, "sampling.presence_penalty"},
        {"frequency < -2", [](Req &q) { q.s.frequency_penalty = -3; }, "sampling.frequency_penalty"},
        {"seed without has_seed", [](Req &q) { q.s.seed = 5; }, "sampling.has_seed"},
        {"no stopping", [](Req &q) { q.r.stopping = nullptr; }, "stopping.max_new_tokens = 0"},
        {"max_new 0", [](Req &q) { q.st.max_new_tokens = 0; }, "stopping.max_new_tokens"},
        {"65 stop ids", [](Req &q) { q.stops.assign(65, 1); }, "stopping.stop_token_ids has 65"},
        {"stop id == vocab", [](Req &q) { q.stops = {0, 300}; }, "stopping.stop_token_ids[1] = 300"},
        {"top_logprobs 21", [](Req &q) { q.r.logprobs = true; q.r.top_logprobs = 21; }, "top_logprobs = 21"},
        {"top_logprobs alone", [](Req &q) { q.r.top_logprobs = 1; }, "needs logprobs"},
    };
}

mt_status check(Req &q, const rtr_model_limits *lim, mt_error *err) { return rtr_validate_generate(q.get(), lim, err); }

// A TokenizeRequest and the storage it points into.
struct Tok {
    Metrale__V1__TokenizeRequest r = METRALE__V1__TOKENIZE_REQUEST__INIT;
    std::string text, kwargs;
    std::vector<std::pair<std::string, std::string>> chat;
    std::vector<Metrale__V1__ChatMessage> msgs;
    std::vector<Metrale__V1__ChatMessage *> msg_ptrs;
    const Metrale__V1__TokenizeRequest *get() {
        r.text = (char *)text.c_str();
        r.chat_template_kwargs = (char *)kwargs.c_str();
        chat_messages(chat, &msgs, &msg_ptrs);
        r.n_messages = msg_ptrs.size();
        r.messages = msg_ptrs.data();
        return &r;
    }
};

std::string tokenize_error(Tok &t, const rtr_model_limits *lim) {
    mt_error err{};
    return rtr_validate_tokenize(t.get(), lim, &err) == MT_OK ? "" : err.msg;
}

}  // namespace

TEST(RouterValidate, TableOfFields) {
    for (const Case &c : cases()) {
        Req q;
        q.get();
        c.edit(q);
        // get() fills pointers from the vectors unless a case cleared a sub-message on purpose.
        Metrale__V1__SamplingParams *keep_s = q.r.sampling;
        Metrale__V1__StoppingCriteria *keep_st = q.r.stopping;
        q.get();
        q.r.sampling = keep_s;
        q.r.stopping = keep_st;
        mt_error err{};
        mt_status st = rtr_validate_generate(&q.r, &kLim, &err);
        if (!c.field) {
            EXPECT_EQ(st, MT_OK) << c.name << ": " << err.msg;
        } else {
            EXPECT_EQ(st, MT_ERR_INVALID) << c.name;
            EXPECT_NE(std::string(err.msg).find(c.field), std::string::npos)
                << c.name << ": message \"" << err.msg << "\" does not name " << c.field;
        }
    }
}

TEST(RouterValidate, WithoutLimitsOnlyModelFreeChecksRun) {
    Req q;
    q.prompt = {100000};
    q.st.max_new_tokens = 1000000;
    mt_error err{};
    EXPECT_EQ(rtr_validate_generate(q.get(), nullptr, &err), MT_OK) << err.msg;
    q.s.top_p = 2;
    EXPECT_EQ(rtr_validate_generate(q.get(), nullptr, &err), MT_ERR_INVALID);
    EXPECT_NE(std::string(err.msg).find("sampling.top_p = 2"), std::string::npos) << err.msg;
}

TEST(RouterValidate, NullRequestIsInvalid) {
    mt_error err{};
    EXPECT_EQ(rtr_validate_generate(nullptr, &kLim, &err), MT_ERR_INVALID);
}

TEST(RouterValidate, TextNeedsATokenizerAndMessagesATemplate) {
    mt_error err{};
    Req ids;
    EXPECT_EQ(check(ids, &kNoTokenizer, &err), MT_OK) << err.msg;  // ids need neither
    Req text;
    text.use_text("hi");
    EXPECT_EQ(check(text, &kNoTemplate, &err), MT_OK) << err.msg;
    ASSERT_EQ(check(text, &kNoTokenizer, &err), MT_ERR_INVALID);
    EXPECT_NE(std::string(err.msg).find("the model has no tokenizer: send prompt_token_ids"), std::string::npos)
        << err.msg;
    Req chat;
    chat.use_chat({{"user", "hi"}});
    ASSERT_EQ(check(chat, &kNoTokenizer, &err), MT_ERR_INVALID);
    EXPECT_NE(std::string(err.msg).find("no tokenizer"), std::string::npos) << err.msg;
    ASSERT_EQ(check(chat, &kNoTemplate, &err), MT_ERR_INVALID);
    EXPECT_NE(std::string(err.msg).find("the model has no chat template"), std::string::npos) << err.msg;
    Req stop;
    stop.stop_strings = {"x"};
    ASSERT_EQ(check(stop, &kNoTokenizer, &err), MT_ERR_INVALID);
    EXPECT_NE(std::string(err.msg).find("stopping.stop: the model has no tokenizer"), std::string::npos) << err.msg;
    // before any Hello the model is unknown: text goes on (the worker answers for its tokenizer)
    EXPECT_EQ(check(text, nullptr, &err), MT_OK) << err.msg;
    EXPECT_EQ(check(chat, nullptr, &err), MT_OK) << err.msg;
}

TEST(RouterValidate, Utf8) {
    for (const std::string &bad : kBadUtf8) {
        Req q;
        q.use_text("x" + bad);
        mt_error err{};
        ASSERT_EQ(check(q, &kLim, &err), MT_ERR_INVALID) << "accepted bytes of " << bad.size();
        EXPECT_NE(std::string(err.msg).find("prompt_text is not valid UTF-8 (byte 1"), std::string::npos) << err.msg;
    }
    const std::string good = "a\xc2\x80\xdf\xbf\xe0\xa0\x80\xed\x9f\xbf\xee\x80\x80\xf0\x90\x80\x80\xf4\x8f\xbf\xbf";
    EXPECT_EQ(rtr_utf8_invalid_at(good.data(), good.size()), good.size());
    EXPECT_EQ(rtr_utf8_invalid_at("", 0), 0u);
    EXPECT_EQ(rtr_utf8_invalid_at("ab\xc3\xa9\xc3", 5), 4u);
}

TEST(RouterValidate, Tokenize) {
    Tok t;
    EXPECT_NE(tokenize_error(t, &kLim).find("neither text nor messages"), std::string::npos);
    t.text = "hello";
    EXPECT_EQ(tokenize_error(t, &kLim), "");
    EXPECT_NE(tokenize_error(t, &kNoTokenizer).find("text: the model has no tokenizer"), std::string::npos);
    t.chat = {{"user", "hi"}};
    EXPECT_NE(tokenize_error(t, &kLim).find("text and messages are both set"), std::string::npos);
    t.text = "";
    EXPECT_EQ(tokenize_error(t, &kLim), "");
    EXPECT_NE(tokenize_error(t, &kNoTemplate).find("no chat template"), std::string::npos);
    t.chat = {{std::string(65, 'r'), "a"}};
    EXPECT_NE(tokenize_error(t, &kLim).find("messages[0].role has 65 bytes"), std::string::npos);
    t.chat = {{"user", "\xc3"}};
    EXPECT_NE(tokenize_error(t, &kLim).find("messages[0].content is not valid UTF-8"), std::string::npos);
    t.chat = Chat(4097, {"user", "a"});
    EXPECT_NE(tokenize_error(t, &kLim).find("messages has 4097"), std::string::npos);
    t.chat = {{"user", "a"}};
    t.kwargs = std::string(MT_WIRE_KWARGS_BYTES_MAX + 1, ' ');
    EXPECT_NE(tokenize_error(t, &kLim).find("chat_template_kwargs has"), std::string::npos);
    t.kwargs = "{}";
    t.r.add_special_tokens = true;
    EXPECT_NE(tokenize_error(t, &kLim).find("has_add_special_tokens"), std::string::npos);
    t.r.has_add_special_tokens = true;
    EXPECT_EQ(tokenize_error(t, &kLim), "");
    Tok bad;
    bad.text = "\xff";
    EXPECT_NE(tokenize_error(bad, &kLim).find("text is not valid UTF-8"), std::string::npos);
    mt_error err{};
    EXPECT_EQ(rtr_validate_tokenize(nullptr, &kLim, &err), MT_ERR_INVALID);
}
