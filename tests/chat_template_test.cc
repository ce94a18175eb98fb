// The chat template renderer (worker/text/chat_template.h) against transformers, through committed
// goldens: tests/fixtures/chat/goldens.jsonl.gz holds apply_chat_template's text (or the fact
// that it raised) for 300 generated conversations on each of the demo model's template
// (tools/train/chat_template.jinja) and a GLM-4 style one (tests/fixtures/chat/glm4_style.jinja),
// and for small templates that cover the subset one construct at a time. The goldens were made
// once by tests/oracle/make_chat_goldens.py (its header says how and with which version); this test
// needs neither transformers nor the network. Every difference fails the test.
#include <gtest/gtest.h>
#include <json-c/json.h>
#include <zlib.h>

#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "worker/text/chat_template.h"

namespace {

const char kGoldens[] = "tests/fixtures/chat/goldens.jsonl.gz";

std::string read_file(const std::string &path) {
    std::ifstream f(path, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

std::vector<std::string> read_gz_lines(const char *path) {
    std::vector<std::string> lines;
    gzFile f = gzopen(path, "rb");
    if (!f) return lines;
    std::string cur;
    char buf[65536];
    int n;
    while ((n = gzread(f, buf, sizeof buf)) > 0)
        for (int i = 0; i < n; i++) {
            if (buf[i] == '\n') lines.push_back(cur), cur.clear();
            else cur += buf[i];
        }
    gzclose(f);
    if (!cur.empty()) lines.push_back(cur);
    return lines;
}

struct Template {
    chat_template *t = nullptr;
    ~Template() { chat_free(t); }
};

struct Result {
    mt_status st;
    std::string text;  // the rendering, or the error message
};

Result render(const chat_template *t, const std::vector<std::pair<std::string, std::string>> &msgs,
              bool agp, const char *kwargs, const chat_vars *vars) {
    std::vector<chat_message> m;
    for (const auto &p : msgs) m.push_back({p.first.c_str(), p.second.c_str()});
    tok_text out = {};
    mt_error err;
    Result r;
    r.st = chat_render(t, m.data(), m.size(), agp, kwargs, vars, &out, &err);
    r.text = r.st == MT_OK ? std::string(out.s, out.n) : std::string(err.msg);
    tok_text_free(&out);
    return r;
}

Result compile_and_render(const char *src, const char *kwargs = nullptr) {
    Template tp;
    mt_error err;
    mt_status st = chat_compile(src, &tp.t, &err);
    if (st != MT_OK) return {st, err.msg};
    return render(tp.t, {{"user", "hi"}}, true, kwargs, nullptr);
}

TEST(ChatTemplate, MatchesTransformersGoldens) {
    std::vector<std::string> lines = read_gz_lines(kGoldens);
    ASSERT_GT(lines.size(), 1u) << "cannot read " << kGoldens;
    json_object *header = json_tokener_parse(lines[0].c_str());
    ASSERT_NE(header, nullptr);
    chat_vars vars = {json_object_get_string(json_object_object_get(header, "bos")),
                      json_object_get_string(json_object_object_get(header, "eos"))};
    std::map<std::string, Template> named;
    const std::map<std::string, std::string> paths = {
        {"demo", "tools/train/chat_template.jinja"},
        {"glm4_style", "tests/fixtures/chat/glm4_style.jinja"}};
    for (const auto &p : paths) {
        std::string src = read_file(p.second);
        ASSERT_FALSE(src.empty()) << p.second;
        mt_error err;
        ASSERT_EQ(chat_compile(src.c_str(), &named[p.first].t, &err), MT_OK) << p.first << ": " << err.msg;
    }
    std::map<std::string, int> total, diffs;
    for (size_t i = 1; i < lines.size(); i++) {
        json_object *row = json_tokener_parse(lines[i].c_str());
        ASSERT_NE(row, nullptr) << "line " << i;
        std::string tpl = json_object_get_string(json_object_object_get(row, "tpl"));
        std::vector<std::pair<std::string, std::string>> msgs;
        json_object *m = json_object_object_get(row, "messages");
        for (size_t k = 0; k < json_object_array_length(m); k++) {
            json_object *p = json_object_array_get_idx(m, k);
            msgs.emplace_back(json_object_get_string(json_object_array_get_idx(p, 0)),
                              std::string(json_object_get_string(json_object_array_get_idx(p, 1)),
                                          json_object_get_string_len(json_object_array_get_idx(p, 1))));
        }
        bool agp = json_object_get_boolean(json_object_object_get(row, "agp"));
        json_object *kw = json_object_object_get(row, "kwargs");
        const char *kwargs = kw ? json_object_get_string(kw) : nullptr;
        Template own;
        const chat_template *t;
        json_object *src = json_object_object_get(row, "template");
        if (src) {
            mt_error err;
            mt_status st = chat_compile(json_object_get_string(src), &own.t, &err);
            ASSERT_EQ(st, MT_OK) << "line " << i << ": " << err.msg;
            t = own.t;
        } else {
            ASSERT_TRUE(named.count(tpl)) << tpl;
            t = named[tpl].t;
        }
        Result r = render(t, msgs, agp, kwargs, &vars);
        json_object *want = json_object_object_get(row, "text");
        bool same;
        std::string expect;
        if (want) {
            expect.assign(json_object_get_string(want), json_object_get_string_len(want));
            same = r.st == MT_OK && r.text == expect;
        } else {
            expect = std::string("an error like ") + json_object_get_string(json_object_object_get(row, "error"));
            same = r.st == MT_ERR_INVALID;
        }
        total[tpl]++;
        if (!same && diffs[tpl]++ < 5)
            ADD_FAILURE() << "line " << i << " (" << tpl << (src ? ": " + std::string(json_object_get_string(src)) : "")
                          << ")\n  got (" << mt_status_str(r.st) << "): " << r.text << "\n  want: " << expect;
        json_object_put(row);
    }
    json_object_put(header);
    for (const auto &p : total) {
        std::printf("%-10s %4d renders, %d differences\n", p.first.c_str(), p.second, diffs[p.first]);
        EXPECT_EQ(diffs[p.first], 0) << p.first;
    }
    EXPECT_GE(total["demo"], 250);
    EXPECT_GE(total["glm4_style"], 250);
}

TEST(ChatTemplate, RefusesUnsupportedConstructsAtCompile) {
    struct Case {
        const char *src, *says;
    } cases[] = {
        {"a\n{% macro f(x) %}{{ x }}{% endmacro %}", "2:4: tag 'macro'"},
        {"{% set ns = namespace(found=false) %}", "function 'namespace'"},
        {"{% for m in messages %}{% set ns.found = true %}{% endfor %}", "set of an attribute"},
        {"{{ messages|map(attribute='role')|join(',') }}", "1:13: filter 'map'"},
        {"{{ x.split(',') }}", "method 'split'"},
        {"{{ messages[1:] }}", "slice"},
        {"{% for k, v in d.items() %}{% endfor %}", "tuples"},
        {"{% for m in messages if m.role %}{% endfor %}", "loop filter"},
        {"{{ {'a': 1} }}", "dict literal"},
        {"{{ 1.5 }}", "number literal"},
        {"{% raw %}{{ x }}{% endraw %}", "tag 'raw'"},
        {"{% generation %}x{% endgeneration %}", "tag 'generation'"},
        {"{% include 'x' %}", "tag 'include'"},
        {"{{ x is divisibleby 3 }}", "1:9: test 'divisibleby'"},
        {"{{ x is defined 3 }}", "test with an argument"},
        {"{{ range(3) }}", "function 'range'"},
        {"{{ x|tojson(indent=2) }}", "keyword argument"},
    };
    for (const Case &c : cases) {
        chat_template *t = nullptr;
        mt_error err;
        EXPECT_EQ(chat_compile(c.src, &t, &err), MT_ERR_UNSUPPORTED) << c.src;
        EXPECT_EQ(t, nullptr);
        EXPECT_NE(std::string(err.msg).find(c.says), std::string::npos) << c.src << " -> " << err.msg;
    }
    const char *syntax[] = {"{% if x %}", "{% endif %}", "{{ x", "{{ 'abc }}", "{# x", "{{ x y }}",
                            "{% for x in %}{% endfor %}", "{% if %}{% endif %}"};
    for (const char *s : syntax) {
        chat_template *t = nullptr;
        mt_error err;
        EXPECT_EQ(chat_compile(s, &t, &err), MT_ERR_INVALID) << s;
        EXPECT_NE(std::string(err.msg).find("chat template 1:"), std::string::npos) << s << " -> " << err.msg;
    }
}

TEST(ChatTemplate, RaiseExceptionIsInvalidWithTheMessage) {
    Result r = compile_and_render("{{ raise_exception('roles must alternate ' ~ messages|length) }}");
    EXPECT_EQ(r.st, MT_ERR_INVALID);
    EXPECT_NE(r.text.find("roles must alternate 1"), std::string::npos) << r.text;

    std::string demo = read_file("tools/train/chat_template.jinja");
    Template tp;
    mt_error err;
    ASSERT_EQ(chat_compile(demo.c_str(), &tp.t, &err), MT_OK) << err.msg;
    r = render(tp.t, {{"user", "hi"}, {"critic", "no"}}, false, nullptr, nullptr);
    EXPECT_EQ(r.st, MT_ERR_INVALID);
    EXPECT_NE(r.text.find("unknown role: critic"), std::string::npos) << r.text;
}

TEST(ChatTemplate, RejectsKwargsThatAreNotAJsonObject) {
    const char *bad[] = {"[1, 2]", "{\"enable_thinking\": fals}", "true", "{} x", "", "\"s\"",
                         "{\"messages\": []}", "{\"add_generation_prompt\": true}"};
    for (const char *k : bad) {
        Result r = compile_and_render("{{ enable_thinking }}", k);
        EXPECT_EQ(r.st, MT_ERR_INVALID) << k;
    }
    Result ok = compile_and_render("{{ enable_thinking }}|{{ x }}", " {\"enable_thinking\": false} ");
    EXPECT_EQ(ok.st, MT_OK) << ok.text;
    EXPECT_EQ(ok.text, "False|");
}

TEST(ChatTemplate, FailedRenderLeavesOutputAsItWas) {
    Template tp;
    mt_error err;
    ASSERT_EQ(chat_compile("abc{{ raise_exception('x') }}", &tp.t, &err), MT_OK);
    tok_text out = {};
    chat_message m = {"user", "hi"};
    ASSERT_EQ(chat_render(tp.t, &m, 1, false, nullptr, nullptr, &out, &err), MT_ERR_INVALID);
    EXPECT_EQ(out.n, 0u);
    tok_text_free(&out);
}

TEST(ChatTemplate, RendersFromManyThreads) {
    std::string src = read_file("tests/fixtures/chat/glm4_style.jinja");
    Template tp;
    mt_error err;
    ASSERT_EQ(chat_compile(src.c_str(), &tp.t, &err), MT_OK) << err.msg;
    std::vector<std::pair<std::string, std::string>> msgs = {
        {"system", "s"}, {"user", "u"}, {"assistant", "<think>t</think>a"}, {"user", "v"}};
    Result want = render(tp.t, msgs, true, "{\"enable_thinking\": false}", nullptr);
    ASSERT_EQ(want.st, MT_OK) << want.text;
    std::vector<std::thread> th;
    std::vector<int> bad(4, 0);
    for (int k = 0; k < 4; k++)
        th.emplace_back([&, k] {
            for (int i = 0; i < 200; i++) {
                Result r = render(tp.t, msgs, true, "{\"enable_thinking\": false}", nullptr);
                bad[k] += r.st != MT_OK || r.text != want.text;
            }
        });
    for (auto &t : th) t.join();
    for (int k = 0; k < 4; k++) EXPECT_EQ(bad[k], 0);
}

}  // namespace
